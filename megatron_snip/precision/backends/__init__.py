"""GEMM backends: one interface, chosen by ``precision.backend``.

* ``emulated`` - ``gemm.quant_linear``: quantize-dequantize in PyTorch, fp32
  GEMMs; runs every format everywhere (the reference).
* ``torch`` - the same autograd function with real FP8 GEMMs through PyTorch's
  scaled-mm per GEMM (``scaled_mm.py``), other formats emulated (recorded);
* ``te`` - Transformer Engine modules with a per-format recipe; needs CUDA and
  the GPU generation each recipe targets (see ``capability.py``).

Pick one with ``get_backend(name)``; validate the plan's formats at start-up
with ``capability.require(name, formats, device)``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megatron_snip.precision.capability import BACKENDS, check
from megatron_snip.precision.plan import GemmPrecision

if TYPE_CHECKING:
    from megatron_snip.precision.gemm import AmaxReducers

__all__ = ["BACKENDS", "Backend", "get_backend"]


class Backend(abc.ABC):
    """Runs a bias-free linear layer Y = X·Wᵀ with a per-GEMM ``GemmPrecision``."""

    name: str
    # Can a graph through ``linear`` be back-propagated more than once (``retain_graph=True``)?
    # The SNIP propagation pass takes many vector-Jacobian products on one forward when it can.
    repeatable_backward: bool = False

    def supports(self, fmt: str, device: torch.device | str | None = None) -> tuple[bool, str]:
        """(ok, reason): can this backend run GEMMs in ``fmt`` on ``device``?"""
        cap = check(self.name, fmt, device)
        return cap.ok, cap.reason

    def end_step(self) -> None:
        """A step's forward/backward scope closed (``LlamaModel.weight_copies_for_step``), before any
        optimizer step: drop whatever was kept for the step's micro-batches (quantized weights)."""

    @abc.abstractmethod
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
        """x (..., K), weight (N, K) -> (..., N) in x's dtype, differentiable w.r.t. both.

        ``amax_reduce``: per-operand amax reductions (``gemm.AmaxReducers``; one callable: every
        operand). ``is_first_microbatch``: TE's weight-cache hint (``WeightCopy.first_microbatch``):
        None = quantize the weight afresh, True = quantize and keep it, False = reuse the kept one
        (the weight has not changed since); backends that quantize per call ignore it."""


def get_backend(name: str, **options: object) -> Backend:
    """The backend called ``name`` (``"emulated"``, ``"torch"`` or ``"te"``), built with ``options``."""
    if name == "emulated":
        from megatron_snip.precision.backends.emulated import EmulatedBackend

        return EmulatedBackend(**options)  # type: ignore[arg-type]
    if name == "torch":
        from megatron_snip.precision.backends.scaled_mm import TorchBackend

        return TorchBackend(**options)  # type: ignore[arg-type]
    if name == "te":
        from megatron_snip.precision.backends.te import TEBackend

        return TEBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"precision.backend={name!r} is not one of {BACKENDS}")
