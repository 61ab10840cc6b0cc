"""The emulated backend: ``gemm.quant_linear`` (PyTorch quantize-dequantize, fp32 GEMMs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_snip.precision.backends.base import Backend
from megatron_snip.precision.gemm import AmaxReducers, quant_linear
from megatron_snip.precision.plan import GemmPrecision


class EmulatedBackend(Backend):
    """Every format on every device; the numerics reference for the other backends.

    Args:
        compiled: run the quantizers through torch.compile (same numerics, faster).
    """

    name = "emulated"
    repeatable_backward = True  # plain autograd (F.linear, or a Function that frees nothing)

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        precision: GemmPrecision,
        *,
        amax_reduce: AmaxReducers | Callable[[torch.Tensor], torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        return quant_linear(x, weight, precision, amax_reduce=amax_reduce, generator=generator, compiled=self.compiled)
