"""SLURM allocation -> one torchrun command per node (c10d rendezvous on the first node).

``launch/slurm/train.sbatch`` runs, on the batch host (the first node of the job)::

    python -m megatron_snip.launcher --print0 CONFIG [--set section.field=value ...]

and hands the printed command to ``srun --ntasks-per-node=1``, so every node starts the same
``torchrun`` and the nodes meet at ``<first node>:<port>``. All SLURM knowledge lives here, in
``torchrun_command`` (pure, tested); the shell scripts stay thin (house rule 9).

Environment read (everything else comes from the config file):

    SLURM_JOB_NODELIST (or SLURM_NODELIST)  hosts, compressed ("node[01-04,07]"); the first
                                            is the rendezvous host
    SLURM_NNODES (or SLURM_JOB_NUM_NODES)   nodes; must match the node list
    NPROC_PER_NODE | SLURM_GPUS_ON_NODE | SLURM_GPUS_PER_NODE ("8", "h100:8") |
    SLURM_NTASKS_PER_NODE                   processes per node, first one set wins
                                            (NPROC_PER_NODE is an explicit override)
    SLURM_JOB_ID                            rendezvous id (jobs sharing a host never join)
    MASTER_PORT                             rendezvous port; default 15000 + SLURM_JOB_ID % 15000
    MAX_RESTARTS                            torchrun --max-restarts (default 3)
    SHUTDOWN_TIMEOUT                        torchrun --shutdown-timeout, seconds (default 240)
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_PORT_BASE, PORT_SPREAD = 15000, 15000  # 15000-29999: below Linux ephemeral ports
DEFAULT_MAX_RESTARTS = 3
DEFAULT_SHUTDOWN_TIMEOUT_S = 240  # below the sbatch warning lead time (USR1@300)
# torchrun's default set plus SIGUSR1, SLURM's time-limit warning, forwarded to the workers.
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
_BRACKET = re.compile(r"\[([^\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: ``"node[01-03,07],gpu-a1"`` -> node01 node02 node03 node07 gpu-a1.

    Supports ranges with zero padding (``[001-010]``), comma lists inside brackets, several
    bracket groups in one name (``rack[1-2]-n[1-2]``, expanded as a product) and plain names.
    """
    if not nodelist or not nodelist.strip():
        raise ValueError("SLURM_JOB_NODELIST is empty; run inside a SLURM allocation (sbatch/salloc)")
    hosts: list[str] = []
    for name in _split_top_level(nodelist.strip()):
        parts = _BRACKET.split(name)  # literal, group, literal, group, ..., literal
        literals, groups = parts[0::2], parts[1::2]
        if any("[" in lit or "]" in lit for lit in literals):
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: unbalanced brackets in {name!r}")
        choices = [_expand_group(g, nodelist) for g in groups]
        for combo in itertools.product(*choices):
            hosts.append("".join(lit + c for lit, c in zip(literals, (*combo, ""), strict=True)))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            names.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: unbalanced brackets")
    names.append(nodelist[start:])
    if any(not n for n in names):
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: empty host name between commas")
    return names


def _expand_group(group: str, nodelist: str) -> list[str]:
    out = []
    for item in group.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: bad range {item!r} (expected e.g. 01-04 or 7)")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: range {item!r} runs backwards")
        width = len(lo)  # SLURM keeps the zero padding of the lower bound
        out.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    return out


def _count(env: Mapping[str, str], name: str) -> int | None:
    """A positive count from ``env[name]``: "8", "8(x4)" (SLURM per-node lists) or "h100:8"."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    text = raw.split("(")[0].split(",")[0].rsplit(":", 1)[-1]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name}={raw!r} is not a positive count (e.g. 8 or h100:8)")
    return int(text)


def nproc_per_node(env: Mapping[str, str]) -> int:
    """Processes (one per GPU) torchrun starts on each node; see the module docstring."""
    for name in ("NPROC_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        n = _count(env, name)
        if n is not None:
            return n
    raise ValueError("cannot tell how many processes to start per node: set NPROC_PER_NODE or request GPUs "
                     "(#SBATCH --gpus-per-node=8, which sets SLURM_GPUS_ON_NODE)")


def _non_negative(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}={raw!r} must be a non-negative integer (default {default})")
    return int(raw)


def torchrun_command(env: Mapping[str, str], config: str, overrides: Sequence[str] = (), *,
                     torchrun: Sequence[str] | None = None) -> list[str]:
    """The torchrun command every node of a SLURM job runs.

    Args:
        env: the SLURM environment (``os.environ`` in the batch script).
        config: path of the TOML config, passed to ``megatron_snip.train --config``.
        overrides: ``section.field=value`` strings, each passed as ``--set`` (after
            ``training.resume=auto``, so a requeued or restarted job continues; an override wins).
        torchrun: the launcher argv prefix; default ``<this python> -m torch.distributed.run``,
            i.e. the torchrun of the environment that runs this function (``$PYTHON``), not
            whichever ``torchrun`` comes first on the compute nodes' PATH.

    Returns:
        argv: TORCHRUN --nnodes=N --nproc_per_node=P --rdzv_backend=c10d
        --rdzv_endpoint=HOST:PORT --rdzv_id=JOBID --max-restarts=R --signals-to-handle=...,SIGUSR1
        --shutdown-timeout=S -m megatron_snip.train --config CONFIG --set training.resume=auto --set ...
        (R = $MAX_RESTARTS, default 3: worker failures restart every worker, which resume from the
        latest verified checkpoint; S = $SHUTDOWN_TIMEOUT, default 240: seconds the workers get to
        write their preemption checkpoint after SIGTERM/SIGUSR1 before torchrun kills them).
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("SLURM_JOB_NODELIST is not set; run inside a SLURM allocation, or use "
                         "launch/torchrun.sh on a single node")
    hosts = expand_nodelist(nodelist)
    nnodes = _count(env, "SLURM_NNODES") or _count(env, "SLURM_JOB_NUM_NODES") or len(hosts)
    if nnodes != len(hosts):
        raise ValueError(f"SLURM_NNODES={nnodes} does not match SLURM_JOB_NODELIST={nodelist!r} ({len(hosts)} hosts)")
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job_id!r} must be the numeric job id (the rendezvous id)")
    port_raw = env.get("MASTER_PORT", "").strip()
    if port_raw:
        if not port_raw.isdigit() or not 1024 <= int(port_raw) <= 65535:
            raise ValueError(f"MASTER_PORT={port_raw!r} must be a port number in 1024-65535")
        port = int(port_raw)
    else:
        port = DEFAULT_PORT_BASE + int(job_id) % PORT_SPREAD  # distinct jobs on one host use distinct ports
    if not config:
        raise ValueError("config path is empty; pass e.g. launch/configs/llama_70b.toml")
    for ov in overrides:
        if "=" not in ov or "\n" in ov:
            raise ValueError(f"override {ov!r} is not 'section.field=value' (e.g. training.max_steps=60)")
    restarts = _non_negative(env, "MAX_RESTARTS", DEFAULT_MAX_RESTARTS)
    shutdown = _non_negative(env, "SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT_S)
    cmd = [
        *(torchrun if torchrun is not None else (sys.executable, "-m", "torch.distributed.run")),
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc_per_node(env)}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={hosts[0]}:{port}",
        f"--rdzv_id={job_id}",
        f"--max-restarts={restarts}",
        f"--signals-to-handle={SIGNALS_TO_HANDLE}",
        f"--shutdown-timeout={shutdown}",
        "-m", "megatron_snip.train",
        "--config", config,
        "--set", "training.resume=auto",
    ]
    for ov in overrides:
        cmd += ["--set", ov]
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_snip.launcher",
                                description="Print (or exec) the per-node torchrun command of a SLURM job")
    p.add_argument("config", help="TOML config, e.g. launch/configs/llama_70b.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--print0", action="store_true", help="print argv NUL-separated (for `mapfile -d ''`)")
    mode.add_argument("--exec", action="store_true", help="replace this process with the torchrun command")
    args = p.parse_args(argv)
    if not Path(args.config).is_file():  # fail here, not once per node after the rendezvous
        print(f"error: config file {args.config!r} does not exist; see launch/configs/", file=sys.stderr)
        return 2
    try:
        cmd = torchrun_command(os.environ, args.config, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.exec:
        os.execvp(cmd[0], cmd)
    if args.print0:
        sys.stdout.write("".join(a + "\0" for a in cmd))
    else:
        print(shlex.join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
