"""The ``Backend`` interface every GEMM backend implements (emulated, torch, te).

Its own module so that the backends import it without importing the package ``__init__``,
which builds them (``get_backend``). Imports: ``plan`` (and ``gemm``'s types) only.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megatron_snip.precision.plan import GemmPrecision

if TYPE_CHECKING:
    from megatron_snip.precision.gemm import AmaxReducers

__all__ = ["Backend"]


class Backend(abc.ABC):
    """Runs a bias-free linear layer Y = X·Wᵀ with a per-GEMM ``GemmPrecision``.

    Whether a backend can run a format on a device is ``backends/support.check(name, fmt, device)``.
    """

    name: str
    # Can a graph through ``linear`` be back-propagated more than once (``retain_graph=True``)?
    # The SNIP propagation pass takes many vector-Jacobian products on one forward when it can.
    repeatable_backward: bool = False

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
