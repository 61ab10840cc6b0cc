"""Start torch.distributed from torchrun's environment and build the TP/PP/DP groups.

    topo = init_distributed(tp=2, pp=2)      # reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    ...
    destroy_distributed()

Backend: NCCL when the run is on CUDA, gloo on CPU. Every rank creates every group, in the
same order (``dist.new_subgroups_by_enumeration`` per kind), as torch requires.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_snip.parallel.topology import GROUP_KINDS, ParallelTopology, check_layout, group_ranks

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_world_size(env: Mapping[str, str] | None = None) -> int:
    """WORLD_SIZE from the environment (1 when not launched by torchrun)."""
    env = os.environ if env is None else env
    raw = env.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment WORLD_SIZE={raw!r} is not an integer; launch with torchrun") from None


def env_rank(env: Mapping[str, str] | None = None) -> int:
    """RANK from the environment (0 when not launched by torchrun)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("RANK", "0"))
    except ValueError:
        raise ValueError(f"environment RANK={env.get('RANK')!r} is not an integer; launch with torchrun") from None


def init_distributed(tp: int, pp: int, *, device_type: str | None = None, timeout_s: float = 600.0,
                     env: Mapping[str, str] | None = None) -> ParallelTopology:
    """Initialize the default process group from torchrun's env and return this rank's topology.

    Args:
        tp, pp: tensor- and pipeline-parallel sizes (``parallel.tp``, ``parallel.pp``); DP = world / (tp*pp).
        device_type: "cuda" -> NCCL (and ``torch.cuda.set_device(LOCAL_RANK)``), "cpu" -> gloo;
            None = cuda when available.
        timeout_s: collective timeout, ``parallel.collective_timeout_s`` (a collective waiting for a
            hung peer fails after this long; parallel/watchdog.py names the hung rank sooner).
        env: environment to read (default ``os.environ``); must hold RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
    """
    env = os.environ if env is None else env
    missing = [k for k in _ENV_KEYS if k not in env]
    if missing:
        raise ValueError(f"distributed launch needs environment variables {missing}; start with "
                         f"torchrun --nproc_per_node=N -m megatron_snip.train ... (launch/torchrun.sh)")
    world_size, rank = env_world_size(env), int(env["RANK"])
    check_layout(world_size, tp, pp)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, the environment says {rank} of {world_size}")
    groups = {}
    for kind in GROUP_KINDS:  # same order on every rank
        groups[f"{kind}_group"], _ = dist.new_subgroups_by_enumeration(group_ranks(world_size, tp, pp)[kind])
    return ParallelTopology.from_rank(world_size, rank, tp, pp, world_group=dist.group.WORLD, **groups)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective (a peer died, hung past the timeout, or reset the
    connection) rather than a bug: torch's ``DistError`` family, or the bare ``RuntimeError``
    gloo raises with its source location (``.../gloo/transport/tcp/pair.cc:537] Read error ...``)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(k in text for k in ("/gloo/", "NCCL", "ProcessGroup", "c10d"))


def destroy_distributed() -> None:
    """Tear down all process groups (no-op when not initialized)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
