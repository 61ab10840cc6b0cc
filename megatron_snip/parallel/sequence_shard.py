"""Sequence parallelism that saves the local shard (Megatron's column-parallel linear under SP).

A column-parallel linear under SP all-gathers its (B, S/tp, K) input to (B, S, K) and its GEMM
saves that gathered input for the wgrad GEMM: tp times the memory of the shard each rank already
holds. ``save_sequence_shard`` is a ``saved_tensors_hooks`` context around the GEMM: a saved
tensor that *is* the gathered input (same storage: the input itself or a view of it, as
``F.linear`` and ``quant_linear`` save it), or autocast's cast of it, is stored as this rank's
sequence shard and all-gathered again (TP group) when backward unpacks it. The values are the
same bits, so numerics do not change; the price is one more all-gather per such tensor in backward.

Overlap (``prefetch_chain``, entered by ``LlamaModel.forward`` for one forward pass of a stage):
the shards saved in one pass are linked in the order they were saved; backward unpacks them in
the reverse order, and when it unpacks one it starts the asynchronous all-gather of the one saved
just before - the next one it will unpack - so that gather runs while backward computes what lies
between (for a block's qkv input: fc1's dgrad/wgrad, the MLP norm, proj and core attention
backward). Megatron overlaps the re-gather with the same GEMM's dgrad instead; an autograd node
unpacks all its saved tensors before it computes, so from a saved-tensor hook the earliest point
is an earlier node. Until its prefetch starts a saved input costs only its shard; from then on its
gathered (B, S, K) copy exists one node earlier than without the overlap (at most one such copy
ahead of the one in use). The shard unpacked first in a pass (the last one saved) is gathered
when unpacked, as without the chain.

Every TP rank runs the same backward graph in the same order, so the all-gathers in the unpack
hooks (and the prefetches they start) line up across the group. Not for use inside a non-reentrant
activation checkpoint (whose own hooks these would shadow) or around SNIP probes (model/layers.py
decides); those linears save nothing here and so drop out of the chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from megatron_snip.parallel import comm


@dataclass(eq=False)
class SequenceShard:
    """What is kept of a saved gathered tensor: this rank's shard and the saved tensor's geometry,
    and its place in the forward pass's ``prefetch_chain``."""

    shard: torch.Tensor  # (B, S/tp, K), the saved tensor's dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    group: Any = None  # the TP group the shard is gathered over
    earlier: SequenceShard | None = None  # saved just before this one in the same pass: unpacked next
    pending: comm.PendingGather | None = None  # its all-gather, from ``prefetch`` until ``gather``
    prefetched: bool = False  # the last ``gather`` waited on a prefetch (for tests and logs)
    used: bool = False  # unpacked at least once: a prefetch now would come too late

    def prefetch(self) -> None:
        """Start the all-gather of the shard in the background, unless started or needed already."""
        if self.pending is None and not self.used:
            self.pending = comm.start_gather_from_sp(self.shard, self.group)

    def gather(self) -> torch.Tensor:
        """The saved (B, S, K) tensor again: the prefetched all-gather's result, or gathered now."""
        pending, self.pending = self.pending, None
        self.prefetched, self.used = pending is not None, True
        with torch.no_grad():
            full = pending.wait() if pending is not None else comm.gather_from_sp(self.shard, self.group).contiguous()
        return full.as_strided(self.size, self.stride, self.offset)


class _Chain:
    """The shards saved so far in one forward pass (only the latest is needed to link the next)."""

    def __init__(self) -> None:
        self.latest: SequenceShard | None = None


# The chain of the forward pass being run (None outside ``prefetch_chain``): scoped like autocast,
# because the column-parallel linears that save into it sit deep inside the blocks.
_CHAIN: ContextVar[_Chain | None] = ContextVar("sequence_shard_chain", default=None)


@contextmanager
def prefetch_chain() -> Iterator[None]:
    """Inside (one forward pass of one stage): each shard ``save_sequence_shard`` keeps is linked to
    the one kept before it, whose all-gather its unpack then starts (module docstring)."""
    token = _CHAIN.set(_Chain())
    try:
        yield
    finally:
        _CHAIN.reset(token)


_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def _is_cast_of(t: torch.Tensor, x_full: torch.Tensor) -> bool:
    """``t`` is (a view of) a whole dtype copy of ``x_full`` - autocast's cast for a BF16 GEMM -
    read off the autograd graph: view nodes, then a ToCopy whose input is ``x_full``."""
    fn = t.grad_fn
    while fn is not None and fn.name() in _VIEWS:
        fn = fn.next_functions[0][0]
    return (fn is not None and x_full.grad_fn is not None and fn.name() == "ToCopyBackward0"
            and fn.next_functions[0][0] is x_full.grad_fn
            and t.untyped_storage().nbytes() == x_full.numel() * t.element_size())


@contextmanager
def save_sequence_shard(x_full: torch.Tensor, x_shard: torch.Tensor, group: Any) -> Iterator[None]:
    """Inside: tensors saved for backward that are ``x_full`` = all-gather(``x_shard``) along the
    sequence dim over ``group`` (or its dtype cast) are kept as the shard. ``x_full`` must be the
    fresh contiguous (B, S, K) result of that gather."""
    full_storage = x_full.untyped_storage()
    full_ptr, full_bytes = full_storage.data_ptr(), full_storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor | SequenceShard:
        st = t.untyped_storage()
        if st.data_ptr() == full_ptr and st.nbytes() == full_bytes and t.dtype == x_full.dtype:
            shard = x_shard
        elif _is_cast_of(t, x_full):
            shard = x_shard.detach().to(t.dtype)
        else:
            return t
        chain = _CHAIN.get()
        saved = SequenceShard(shard.detach(), tuple(t.shape), tuple(t.stride()), t.storage_offset(), group,
                              earlier=chain.latest if chain is not None else None)
        if chain is not None:
            chain.latest = saved
        return saved

    def unpack(saved: torch.Tensor | SequenceShard) -> torch.Tensor:
        if not isinstance(saved, SequenceShard):
            return saved
        full = saved.gather()
        if saved.earlier is not None:  # after this rank's own gather: the same order on every TP rank
            saved.earlier.prefetch()
        return full

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
