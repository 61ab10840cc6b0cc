"""Sequence parallelism that saves the local shard (Megatron's column-parallel linear under SP).

A column-parallel linear under SP all-gathers its (B, S/tp, K) input to (B, S, K) and its GEMM
saves that gathered input for the wgrad GEMM: tp times the memory of the shard each rank already
holds. ``save_sequence_shard`` is a ``saved_tensors_hooks`` context around the GEMM: a saved
tensor that *is* the gathered input (same storage: the input itself or a view of it, as
``F.linear`` and ``quant_linear`` save it), or autocast's cast of it, is stored as this rank's
sequence shard and all-gathered again (TP group) when backward unpacks it. The values are the
same bits, so numerics do not change; the price is one more all-gather per such tensor in
backward (not overlapped with compute here, unlike Megatron's).

Every TP rank runs the same backward graph in the same order, so the all-gathers in the unpack
hooks line up across the group. Not for use inside a non-reentrant activation checkpoint (whose
own hooks these would shadow) or around SNIP probes (model/layers.py decides).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from megatron_snip.parallel import comm


@dataclass
class SequenceShard:
    """What is kept of a saved gathered tensor: this rank's shard and the saved tensor's geometry."""

    shard: torch.Tensor  # (B, S/tp, K), the saved tensor's dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


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
        return SequenceShard(shard.detach(), tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def unpack(saved: torch.Tensor | SequenceShard) -> torch.Tensor:
        if not isinstance(saved, SequenceShard):
            return saved
        with torch.no_grad():
            full = comm.gather_from_sp(saved.shard, group).contiguous()
        return full.as_strided(saved.size, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
