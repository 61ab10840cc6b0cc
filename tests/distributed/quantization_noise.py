"""How far a low-precision parallel run may drift from its single-process reference, in units of
the quantization noise itself (no constant fitted to one CPU's BLAS).

A parallel layout changes only the order of fp32 sums. Through a quantizer that is an ulp-level
nudge of the operand, which changes its quantized value only where the value lay within that
nudge of a rounding boundary: there the element moves by one whole quantization step ``s`` (a
*flip*). How many values sit that close depends on the CPU's matmul blocking (an AVX-512 machine
flips more of them than an AVX2 one), so no fixed tolerance can hold everywhere. What does hold:

* round-to-nearest leaves an error uniform in [-s/2, s/2] per element, rms ``s / sqrt(12)``;
* a fraction ``f`` of elements flipped by one step moves the operand by rms ``s * sqrt(f)``;
* both perturbations travel through the same network, so their effects on the loss, the
  gradients and the weights keep (to first order) the ratio ``sqrt(12 f)``.

So the drift ``||parallel - reference||`` is compared with the quantization effect
``||reference - reference_bf16||`` (the same single-process run with every GEMM in BF16, = fp32
on CPU): a flip budget of 2% of all quantized elements allows ``MAX_RATIO = sqrt(12 * 0.02)``
~ 0.49. Any sharding bug (per-shard scales where the reference has global ones, a block that
straddles a shard boundary, another format on one stage) re-draws the quantization error of the
affected operands: an independent error of the same size, ratio ~ sqrt(2) >= 1, so it fails.
"""

from __future__ import annotations

import math

import torch

FLIP_BUDGET = 0.02  # fraction of quantized elements that may flip by one step
MAX_RATIO = math.sqrt(12 * FLIP_BUDGET)


def drift_ratio(got: list[torch.Tensor], ref: list[torch.Tensor], ref_bf16: list[torch.Tensor]) -> float:
    """||got - ref|| / ||ref - ref_bf16|| over all tensors together (each list pairs the same
    entries: e.g. a rank's parameter shards and the matching slices of the references)."""
    drift = sum(float((g.double() - r.double()).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    noise = sum(float((r.double() - b.double()).pow(2).sum()) for r, b in zip(ref, ref_bf16, strict=True))
    assert noise > 0, "the low-precision reference equals the BF16 one: the plan quantizes nothing"
    return math.sqrt(drift / noise)
