"""Recompute cheap elementwise work in backward instead of saving its intermediates.

``recompute_cheap(fn, *inputs)`` runs ``fn`` under a non-reentrant ``torch.utils.checkpoint``:
of everything ``fn``'s ops would save for backward, only ``inputs`` are kept (by reference);
the intermediates are re-made by re-running ``fn`` when backward first needs them. Used where
the recomputation costs a few elementwise passes and the saved intermediates would be wider
than the inputs (Megatron's count of what a block saves assumes these): RMSNorm (saves its
input instead of its fp32 input, 1/rms and fp32 normalized output) and SwiGLU (saves fc1's
output instead of that plus silu(gate)).

Why bitwise: the non-reentrant checkpoint keeps the original autograd graph and only
re-creates its saved tensors with the same ops on the same inputs (deterministic elementwise
kernels, autocast state restored), so gradients - and the order in which they accumulate -
are those of the plain graph. ``fn`` must not draw random numbers (the RNG state is not
saved). Under no_grad (evaluation) ``fn`` just runs.

``keep_intermediates()`` turns recompute off for a graph that is differentiated many times
(SNIP's propagation pass runs one backward per linear on one retained graph, with
``retain_graph``): a checkpointed region re-runs its forward in *every* backward that reaches it,
so there it would run once per linear instead of once. Same gradients either way (above).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["keep_intermediates", "recompute_allowed", "recompute_cheap"]

_keep_depth = 0  # > 0 inside keep_intermediates()


@contextlib.contextmanager
def keep_intermediates() -> Iterator[None]:
    """Within: ``recompute_cheap`` and the attention core's selective recompute save their
    intermediates as the plain graph does (see the module docstring). Nests."""
    global _keep_depth
    _keep_depth += 1
    try:
        yield
    finally:
        _keep_depth -= 1


def recompute_allowed() -> bool:
    """Whether a checkpoint may be placed now: grad mode on and not inside ``keep_intermediates``."""
    return torch.is_grad_enabled() and _keep_depth == 0


def recompute_cheap(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``, saving only ``inputs`` for backward (see the module docstring)."""
    if not recompute_allowed():
        return fn(*inputs)
    return checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=False)
