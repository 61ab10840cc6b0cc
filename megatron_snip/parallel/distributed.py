"""Start torch.distributed from torchrun's environment and build the TP/PP/DP groups.

    topo = init_distributed(tp=2, pp=2)      # reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    ...
    destroy_distributed()

Backend: NCCL when the run is on CUDA, gloo on CPU. Every rank creates every group, in the
same order (``dist.new_subgroups_by_enumeration`` per kind), as torch requires.

On NCCL every group is bound to this rank's GPU (``device_id``), which creates its communicator
at start-up (torch splits the default one): ``comm.exchange``'s batched p2p is then never a
group's first call, and ``comm.group_device`` reads the device from the group. A collective that
times out on NCCL does not raise: NCCL's watchdog thread tears the process down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, set here unless the environment chose a mode, as
torchrun does), so nothing in the training loop can catch it. A hung or dead peer is named
by parallel/watchdog.py's heartbeat, whose limit (half of ``parallel.collective_timeout_s``)
ends every survivor before the watchdog's timeout fires.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_snip.parallel.topology import GROUP_KINDS, ParallelTopology, check_layout, group_ranks

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# TearDown: on a timeout or NCCL error the watchdog aborts the communicators and ends the process,
# so a rank stuck in a collective cannot outlive the timeout. torchrun's default too; without
# torchrun torch's default (3, SkipCleanUp) also ends the process, but without aborting first.
NCCL_ASYNC_ERROR_HANDLING = "1"


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """This rank's GPU among the ``device_count`` it sees: ``LOCAL_RANK % device_count``.

    torchrun shows every GPU of the node to every worker (index = LOCAL_RANK); a scheduler that
    gives each task its own GPU (SLURM ``--gpus-per-task=1``) shows one, index 0, whatever the
    LOCAL_RANK."""
    if device_count < 1:
        raise ValueError("parallel training on CUDA, but this process sees no GPU (CUDA_VISIBLE_DEVICES, the "
                         "scheduler's GPU request); or set training.device=cpu for gloo")
    return local_rank % device_count


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
        device_type: "cuda" -> NCCL on GPU ``cuda_device_index(LOCAL_RANK, device_count())``, made
            current and bound to every group; "cpu" -> gloo; None = cuda when available.
        timeout_s: collective timeout, ``parallel.collective_timeout_s`` (a collective waiting for a
            hung peer fails after this long - on NCCL by ending the process; parallel/watchdog.py
            names the hung rank sooner).
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
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", cuda_device_index(int(env.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
        torch.cuda.set_device(device)
        # Read when the NCCL process group is created: set before init_process_group.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ASYNC_ERROR_HANDLING)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                                rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, the environment says {rank} of {world_size}")
    groups = {}
    for kind in GROUP_KINDS:  # same order on every rank
        groups[f"{kind}_group"], _ = dist.new_subgroups_by_enumeration(group_ranks(world_size, tp, pp)[kind])
    return ParallelTopology.from_rank(world_size, rank, tp, pp, world_group=dist.group.WORLD, device=str(device),
                                      **groups)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective (a peer died, hung past the timeout, or reset the
    connection) rather than a bug: torch's ``DistError`` family, or the bare ``RuntimeError``
    gloo raises with its source location (``.../gloo/transport/tcp/pair.cc:537] Read error ...``).
    On NCCL a timed-out collective ends the process from torch's watchdog instead (module docstring)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(k in text for k in ("/gloo/", "NCCL", "ProcessGroup", "c10d"))


def destroy_distributed() -> None:
    """Tear down all process groups (no-op when not initialized)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
