"""The dry run: what a config costs on ``world_size`` GPUs (memory, FLOPs, the SNIP ILP's size,
GEMM time), computed from shapes alone - no model, no device, no process group.

Owns: ``result.py`` (the ``Sizing`` dataclasses), ``gemm_time.py`` (the GEMM-time lines; imports
``result`` only), ``dry_run.py`` (``estimate``, ``activation_bytes``, ``dry_run_report``).
May import: ``config``, ``precision``, ``model`` (shapes), ``snip`` (feasibility); never
``training``, ``interop`` or the entry points.
"""

from megatron_snip.sizing.dry_run import (
    DEFAULT_GPU,
    GIB,
    GPU_ENV,
    activation_bytes,
    dry_run_report,
    estimate,
    resolve_gpu,
)
from megatron_snip.sizing.gemm_time import gemm_time_lines
from megatron_snip.sizing.result import (
    ADAM_BYTES,
    GRAD_BYTES,
    WEIGHT_BYTES,
    ActivationBytes,
    Sizing,
    SnipSizing,
    StageSizing,
)

__all__ = [
    "ADAM_BYTES",
    "DEFAULT_GPU",
    "GIB",
    "GPU_ENV",
    "GRAD_BYTES",
    "WEIGHT_BYTES",
    "ActivationBytes",
    "Sizing",
    "SnipSizing",
    "StageSizing",
    "activation_bytes",
    "dry_run_report",
    "estimate",
    "gemm_time_lines",
    "resolve_gpu",
]
