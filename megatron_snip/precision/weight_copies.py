"""One low-precision copy of a weight per step, instead of one per micro-batch in flight.

Under BF16 autocast a linear on the reference path (every GEMM BF16) multiplies a BF16 copy of
its fp32 master weight, and its backward keeps that copy until the micro-batch's backward has
run. A pipeline stage with m micro-batches in flight (1F1B: up to pp on the first stage) would
hold m copies of the same values. ``WeightCopy`` makes the copy once while a step's scope is open
(``LlamaModel.weight_copies_for_step``, around a step's forward and backward passes) and hands
the same tensor to every micro-batch; the scope closes - and the copy is dropped - before the
optimizer changes the weight.

Why bitwise: each micro-batch's graph uses the cached copy exactly as it used its own
``weight.to(dtype)`` (same rounding of the same fp32 values); its gradient flows back through
the copy's ``ToCopyBackward`` (no saved tensors, so several backward passes may run through it)
into the fp32 weight's gradient, once per micro-batch, in the same order as before.

A guard against stale copies: the copy is re-made if the weight's version counter moved (an
in-place update inside a scope). Outside a scope, under no_grad, or with ``enabled`` False (fully
recomputed blocks, whose copies recompute would otherwise keep alive for the whole step) every
call casts afresh, as ``F.linear`` under autocast does.

Transformer Engine keeps its quantized weight the same way when told which micro-batch is the
step's first (``te.Linear(..., is_first_microbatch=)``): ``first_microbatch`` gives that flag
from the same scope, so TE quantizes each weight once per step, not once per micro-batch.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = ["WeightCopy"]


class WeightCopy:
    """The per-step cache of one weight's copy in the activation dtype (see the module docstring)."""

    def __init__(self) -> None:
        self.enabled = True  # LlamaModel.set_recompute turns it off inside fully recomputed blocks
        self._open = False
        self._copy: tuple[torch.dtype, int, torch.Tensor] | None = None  # (dtype, weight version, copy)
        self._first_seen: set[tuple[Hashable, int]] = set()  # (key, weight version) flagged this scope

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` (N, K) cast to ``dtype``, differentiable w.r.t. ``weight``: the step's copy
        while a scope is open, else a fresh cast (``weight`` itself if already in ``dtype``)."""
        if weight.dtype == dtype:
            return weight
        if not (self._open and self.enabled and torch.is_grad_enabled()):
            return weight.to(dtype)
        hit = self._copy
        if hit is None or hit[0] != dtype or hit[1] != weight._version:
            hit = self._copy = (dtype, weight._version, weight.to(dtype))
        return hit[2]

    def first_microbatch(self, weight: torch.Tensor, key: Hashable) -> bool | None:
        """TE's ``is_first_microbatch`` for a forward of ``weight`` run as ``key`` (its precision):
        None outside a scope, under no_grad or when disabled (quantize afresh, keep nothing); True
        on the scope's first call per key, or once the weight changed in place (quantize and keep
        it); False after that (reuse the kept copy: the weight has not changed since)."""
        if not (self._open and self.enabled and torch.is_grad_enabled()):
            return None
        seen = (key, weight._version)
        if seen in self._first_seen:
            return False
        self._first_seen.add(seen)
        return True

    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        """End the step's scope: drop the copy (its memory is freed once no graph holds it)."""
        self._open, self._copy = False, None
        self._first_seen.clear()
