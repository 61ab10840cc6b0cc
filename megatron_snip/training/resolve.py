"""What a run's settings resolve to before training starts: the device, the autocast dtype, the
initial precision plan (``training.device``, ``training.dtype``, ``precision.initial_plan``), the
GEMM backend (``precision.backend``) and the data every rank reads."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_snip.config import Config
from megatron_snip.data.pipeline import DataBundle, build_data
from megatron_snip.parallel import comm
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.precision.backends import Backend, get_backend
from megatron_snip.precision.backends.support import require
from megatron_snip.precision.plan import GemmId, PrecisionPlan


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("config training.device='cuda' but CUDA is not available; set training.device=cpu or auto")
    return torch.device(name)


def resolve_autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32. CPU default is fp32: exact, and bitwise-resumable."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if name == "bfloat16" else None


def resolve_initial_plan(cfg: Config, gemm_ids: list[GemmId], linear_numel: dict[str, int]) -> PrecisionPlan:
    """``precision.initial_plan``: "bf16", "uniform:<format>", a baseline policy spec, or a plan JSON path."""
    spec = cfg.precision.initial_plan
    num_layers = cfg.model.num_layers
    if _looks_like_path(spec):
        try:
            plan = PrecisionPlan.load(spec, linear_numel)
            plan.validate(gemm_ids)  # here, so that a mismatch names the file and the field
        except ValueError as e:
            raise ValueError(f"config precision.initial_plan={spec!r}: {e}") from None
    elif spec == "bf16":
        plan = PrecisionPlan.uniform("bf16", num_layers, linear_numel, policy="bf16")
    elif spec.startswith("uniform:"):
        plan = PrecisionPlan.uniform(spec.split(":", 1)[1], num_layers, linear_numel)
    else:
        from megatron_snip.snip.policies import PlanContext, make_plan, needs_costs

        if needs_costs(spec):
            raise ValueError(f"config precision.initial_plan={spec!r} needs statistics that exist only after "
                             f"training starts; use it as snip.policy and start from 'bf16' or 'uniform:fp8'")
        plan = make_plan(spec, PlanContext.for_run(cfg.snip, num_layers, linear_numel, cfg.parallel.pp,
                                                   backend=cfg.precision.backend))
    plan.validate(gemm_ids)
    return plan


def _looks_like_path(spec: str) -> bool:
    """A file name rather than a policy spec: it exists, has a folder part or a file suffix
    (policy specs are ``name[:args]`` with no ``/`` and no ``.json``/``.txt`` ending)."""
    return Path(spec).exists() or "/" in spec or os.sep in spec or Path(spec).suffix.lower() in (".json", ".txt")


def build_backend(cfg: Config, initial_plan: PrecisionPlan, device: torch.device, tp_size: int,
                  autocast_dtype: torch.dtype | None) -> Backend:
    """The GEMM backend ``precision.backend`` names, refused at start-up (with the reason and
    the fix) if it cannot run the initial plan's formats (whatever form ``precision.initial_plan``
    took) or SNIP's candidate formats on ``device``. ``tp_size``: the TP group's size (TE's per-shard amaxes)."""
    p = cfg.precision
    formats = {f for _, f in initial_plan.entries} | {"bf16"}
    if cfg.snip.enabled:
        formats |= set(cfg.snip.formats)
    require(p.backend, formats, device)
    if p.backend == "te":
        backend = get_backend("te", tp_size=tp_size, tp_amax=p.tp_amax)
        backend.check_run(initial_plan, formats, activation_dtype=autocast_dtype or torch.float32,
                          per_gemm_replans=cfg.snip.enabled and cfg.snip.granularity == "gemm")
        return backend
    return get_backend(p.backend, compiled=p.compile_quantizers)  # emulated or torch


def build_data_on_ranks(cfg: Config, topo: ParallelTopology, is_writer: bool) -> DataBundle:
    """This rank's data (``data/pipeline.build_data``). Rank 0 tokenizes into the cache (once per
    job, on shared storage if data.cache_dir is) and checks the data first; the others then only
    read it - or raise rank 0's error instead of waiting for it in a collective (one object
    broadcast over the world group)."""
    world = topo.world_group
    if topo.is_distributed and not is_writer:
        error = comm.broadcast_object(None, 0, world)
        if error:
            raise ValueError(error)
        return build_data(cfg, is_writer=False)
    try:
        data = build_data(cfg, is_writer=is_writer)
    except ValueError as e:
        if topo.is_distributed:
            comm.broadcast_object(str(e), 0, world)
        raise
    if topo.is_distributed:
        comm.broadcast_object(None, 0, world)
    return data
