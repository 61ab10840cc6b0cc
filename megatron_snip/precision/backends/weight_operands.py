"""Each weight's scaled-mm operands quantized once per step, not once per GEMM and micro-batch.

A step runs fprop and dgrad of every linear on each of its micro-batches with the same weight W:
quantizing W afresh each time (fprop's Q(W), dgrad's Q(Wᵀ)) reads the fp32 master weight 2m
times per step for m micro-batches, plus an amax pass each time. Transformer Engine keeps the
quantized weight instead, told by ``is_first_microbatch`` when to make it; ``WeightOperands`` does
the same for the torch backend, from the same flag (``WeightCopy.first_microbatch``):

  * ``first=True`` (a step's first forward of this weight in this precision, or the weight changed
    in place since): every operand this call uses is made afresh from W - the first one
    quantized, the other layout of the same format transposed from it;
  * ``first=False`` (the weight has not changed since): operands made earlier in the step are
    reused; one not made yet is made and kept;
  * ``first=None`` (outside a step's scope: evaluation, statistics passes): nothing is cached.

Why dgrad's operand may be fprop's transposed: the formats with a scaled-mm here scale W per
tensor (``fp8``: one amax, the same for Wᵀ) or in 128x128 blocks (``fp8_block``: Wᵀ's blocks are
W's blocks transposed, with the same amaxes), so Q(Wᵀ) == Q(W)ᵀ element for element and scale
for scale (tests/unit/test_fp8_fast_path.py checks it bitwise). The transpose moves 2 bytes per
weight element (float8 read + write) where a re-quantization moves 9 (fp32 read twice, float8
write).

Why a stale operand cannot be used: (1) the cache is emptied when the step's scope closes
(``LlamaModel.weight_copies_for_step`` -> ``Backend.end_step``), which is before every optimizer
step, and the next scope's first forward of each weight has ``first=True``; (2) every entry is
stamped with the weight's version counter and storage pointer, and an entry whose stamp differs
from the weight's is never used, whatever the flag says (an in-place update inside a scope bumps
the version). tests/unit/test_fp8_fast_path.py updates a weight both ways and checks.

``counts`` counts what happened, for the tests and the GEMM byte model: "quantize" (a weight
operand made from the high-precision weight), "transpose" (made from the other layout) and
"reuse".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megatron_snip.precision.quantize.scaled import ScaledOperand

__all__ = ["WeightOperands", "WeightSlot"]

_Key = tuple[str, str]  # (format, "rowwise" = W (N, K) | "colwise" = Wᵀ (K, N))
_Stamp = tuple[int, int]  # (weight._version, weight.data_ptr())


def _transposed(op: ScaledOperand) -> ScaledOperand:
    """Q(W)ᵀ as a scaled-mm operand: row-major float8 codes of Wᵀ and the scales' transpose."""
    scale = op.scale if op.scale.dim() == 0 else op.scale.t().contiguous()
    return ScaledOperand(op.elements.t().contiguous(), scale)


class WeightOperands:
    """The per-step cache of every weight's scaled-mm operands (one per torch backend); see the module docstring."""

    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> {key: (stamp, operand)}
        self.counts: Counter[str] = Counter()

    def slot(self, weight: torch.Tensor, first: bool | None) -> WeightSlot | None:
        """The view of the cache one ``linear`` call uses for ``weight`` (None: ``first`` is None, no caching)."""
        return None if first is None else WeightSlot(self, weight, first)

    def clear(self) -> None:
        """Drop every cached operand (the step's scope closed; the optimizer may change the weights next)."""
        self._entries.clear()

    def _get(self, weight: torch.Tensor, b: torch.Tensor, fmt: str, trusted: Callable[[_Key], bool],
             make: Callable[[], ScaledOperand], made: set[_Key]) -> ScaledOperand:
        assert b.data_ptr() == weight.data_ptr() and b.dim() == 2, "b must be the weight or its transpose"
        layout = "rowwise" if b.shape == weight.shape and b.stride() == weight.stride() else "colwise"
        key, other = (fmt, layout), (fmt, "colwise" if layout == "rowwise" else "rowwise")
        stamp: _Stamp = (weight._version, weight.data_ptr())
        entries = self._entries.setdefault(weight, {})
        hit = entries.get(key)
        if hit is not None and hit[0] == stamp and trusted(key):
            self.counts["reuse"] += 1
            return hit[1]
        source = entries.get(other)
        if source is not None and source[0] == stamp and trusted(other):
            op = _transposed(source[1])
            self.counts["transpose"] += 1
        else:
            op = make()
            self.counts["quantize"] += 1
        entries[key] = (stamp, op)
        made.add(key)
        return op


class WeightSlot:
    """One ``linear`` call's access to ``WeightOperands`` for its weight, with that call's ``first`` flag.

    Held by the call's GEMM runner from its forward to its backward (dgrad), so the flag given at
    the micro-batch's forward governs its dgrad too: with ``first=True`` only operands this slot
    made are trusted, with ``first=False`` any entry whose stamp matches the weight."""

    def __init__(self, cache: WeightOperands, weight: torch.Tensor, first: bool) -> None:
        self.cache, self.weight, self.first = cache, weight, first
        self.made: set[_Key] = set()

    def operand(self, b: torch.Tensor, fmt: str, make: Callable[[], ScaledOperand]) -> ScaledOperand:
        """The scaled-mm operand of ``b`` (the weight (N, K) or its transpose (K, N)) in ``fmt``,
        ``make()`` (the quantization of ``b``) where no trusted operand is cached."""
        trusted = (lambda key: key in self.made) if self.first else (lambda key: True)
        return self.cache._get(self.weight, b, fmt, trusted, make, self.made)
