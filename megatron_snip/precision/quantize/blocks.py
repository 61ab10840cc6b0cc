"""Block scaling: the quantize-dequantize math of one 2-D operand in its physical layout.

The shape rules an operand must meet are in ``precision/gemm_shapes.py``.

``_qdq`` is the specification of every format's scaling (tensor, power-of-two
blocks, E8M0 blocks, E4M3 blocks under an FP32 tensor scale); ``quantize`` in
this package's ``__init__`` is its public entry point.
"""

from __future__ import annotations

import struct

import torch

from megatron_snip.precision.formats import E2M1, E4M3, E5M2, Element, Format, Operand, Scaling
from megatron_snip.precision.quantize.bits import (
    _F32_MAX,
    _div_rn,
    _exp2i,
    _f32_bits,
    _floor_log2,
    _mantissa_bits,
    _rdiv,
)
from megatron_snip.precision.quantize.hadamard import _rht_physical
from megatron_snip.precision.quantize.noise import _noise_physical
from megatron_snip.precision.quantize.rounding import round_e4m3, round_to_element

_NVFP4_TENSOR_MAX = E4M3.max * E2M1.max  # 448 * 6: the NVFP4 tensor scale maps the tensor amax here
# fl32(1/6): TE folds the E2M1 reciprocal into the tensor-scale multiplier; we round it the same way.
_RCP_E2M1_MAX = struct.unpack("<f", struct.pack("<f", 1.0 / E2M1.max))[0]
# Fraction bits of each element's max (448 = 1.75 * 2**8 -> 0x600000). Precomputed:
# torch.compile cannot trace ``struct``.
_MAX_MANTISSA_BITS = {e.name: _f32_bits(e.max) & 0x7FFFFF for e in (E4M3, E5M2, E2M1)}


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor (NaN if x has a NaN) - the local amax to reduce over TP.

    One pass over x, no |x| temporary: ``torch.aminmax`` reads x once and max |x| = max(-min, max)
    exactly (negation is exact; NaN propagates through aminmax and maximum). ``x.abs().amax()``
    would write a full |x| and read it again: 3 passes' worth of memory traffic for 1. x may be
    bf16 (its max is a bf16 value, so the fp32 result is the fp32 tensor's amax bit for bit).
    tests/unit/test_fp8_fast_path.py counts the passes."""
    lo, hi = torch.aminmax(x.detach())
    # abs: for an all-zero x, maximum(-0.0, 0.0) may be -0.0, and 448 * 6 / -0.0 = -Inf would poison
    # NVFP4's tensor scale (0-d: a scalar op, not a pass)
    return torch.maximum(-lo, hi).abs().to(torch.float32)


def _tensor_scales(a: torch.Tensor, elem: Element) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode, decode) scales of per-tensor scaling for the 0-d tensor amax ``a``.

    encode = fl(max / amax) (one correctly rounded division, as TE), 1 for an all-zero
    tensor; decode = fl(1 / encode), NaN when the amax is not finite.
    """
    scale = _rdiv(elem.max, a).clamp(max=_F32_MAX)  # a tiny -> Inf -> the largest float
    scale = torch.where(a == 0, torch.ones_like(scale), scale)
    scale_inv = torch.where(torch.isfinite(a), 1.0 / scale, torch.full_like(scale, float("nan")))
    return scale, scale_inv


def _pow2_block_scales(block_amax: torch.Tensor, elem: Element) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode, decode) power-of-two scales per block (TE Float8BlockScaling with pow2 scales).

    encode = 2**floor(log2(max / amax)), so the block max never saturates; 1 for an all-zero
    block; decode = its exact inverse, NaN for a block whose amax is not finite.
    """
    k = _floor_log2(_rdiv(elem.max, block_amax)).clamp(-127, 127)
    k = torch.where(block_amax == 0, torch.zeros_like(k), k)
    scale_inv = torch.where(torch.isfinite(block_amax), _exp2i(-k), torch.full_like(block_amax, float("nan")))
    return _exp2i(k), scale_inv


def _nvfp4_tensor_scales(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's FP32 (encode, decode) tensor scales for the 0-d tensor amax ``a`` (TE's reference).

    encode = fl(448 * 6 / amax) (largest float if that overflows; 1 when it is 0, i.e. an
    infinite amax), decode = fl(1 / encode).
    """
    s_enc = _rdiv(_NVFP4_TENSOR_MAX, a).clamp(max=_F32_MAX)
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
    return s_enc, 1.0 / s_enc


def scaled_elements(
    p: torch.Tensor, spec: Format, operand: Operand, amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The on-grid elements and decode scales ``_qdq`` multiplies (formats whose elements need no noise).

    For the scaled-mm GEMMs (``backends/scaled_mm.py``): ``elements * scale`` (broadcast over
    blocks) is ``_qdq``'s result bit for bit, because it is the same computation stopped before
    its last multiplication.

    Args:
        p: contiguous fp32 (R, C) logical operand, reduction dim last.
        spec: a format with per-tensor (``fp8``) or power-of-two block (``fp8_block``) scaling.
        amax: tensor amax already reduced over TP, or None for the local one (per-tensor only).
    Returns:
        (elements fp32 (R, C) on the element grid, saturated, NaN kept;
         decode scales fp32: 0-d for per-tensor scaling, (R / br, C / bc) for blocks).
    """
    elem = spec.element_for(operand)
    assert elem is not None and not spec.stochastic_for(operand) and p.is_contiguous()
    if spec.scaling is Scaling.TENSOR:
        scale, scale_inv = _tensor_scales(tensor_amax(p) if amax is None else amax, elem)
        return round_to_element(p * scale, elem), scale_inv
    assert spec.scaling is Scaling.BLOCK_POW2, spec.scaling
    br, bc = spec.block_for(operand)
    pb = p.reshape(p.shape[0] // br, br, p.shape[1] // bc, bc)
    scale, scale_inv = _pow2_block_scales(pb.abs().amax(dim=(1, 3), keepdim=True), elem)
    return round_to_element(pb * scale, elem).reshape(p.shape), scale_inv.reshape(p.shape[0] // br, p.shape[1] // bc)


def _qdq(
    p: torch.Tensor,
    spec: Format,
    operand: Operand,
    hadamard: bool,
    colwise: bool,
    amax: torch.Tensor | None,
    seeds: torch.Tensor | None,
) -> torch.Tensor:
    """The quantize-dequantize math of one operand, in its physical layout.

    Args:
        p: contiguous fp32 physical tensor: the logical operand x (R, C) itself
            (``colwise=False``) or xᵀ (C, R) (``colwise=True``).
        amax: tensor amax (of the rotated operand) or None for the local one.
        seeds: int32 (2,) stochastic-rounding seeds, or None for RNE.
    Returns:
        the dequantized operand in p's layout and shape.
    """
    return _qdq_noise(p, spec, operand, hadamard, colwise, amax, None if seeds is None else stochastic_noise(p, colwise, seeds))


def stochastic_noise(p: torch.Tensor, colwise: bool, seeds: torch.Tensor) -> torch.Tensor:
    """The uniform [0, 1) stochastic-rounding draws of physical operand ``p`` (fp32, p's layout and
    shape): element (i, j) of the logical operand gets counter i * cols + j (``_noise_physical``)."""
    rows, cols = (p.shape[1], p.shape[0]) if colwise else (p.shape[0], p.shape[1])
    return _noise_physical(rows, cols, colwise, seeds)


def _qdq_noise(
    p: torch.Tensor,
    spec: Format,
    operand: Operand,
    hadamard: bool,
    colwise: bool,
    amax: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> torch.Tensor:
    """``_qdq`` with its stochastic-rounding draws given (``stochastic_noise``; None for RNE).

    A separate entry so that the compiled variant can make the draws in a kernel of their own
    where that is faster (``compiled.draws_apart``)."""
    if hadamard:
        p = _rht_physical(p, colwise)
    if not spec.quantizes:
        return p
    elem = spec.element_for(operand)
    assert elem is not None

    if spec.scaling is Scaling.TENSOR:
        scale, scale_inv = _tensor_scales(tensor_amax(p) if amax is None else amax, elem)
        return round_to_element(p * scale, elem, noise).mul_(scale_inv)

    # Blocked formats: view p as (P0/b0, b0, P1/b1, b1) so that 1-D (one block dim
    # is 1) and 2-D blocks, rowwise and colwise, share one code path. Full-size
    # temporaries are updated in place (fewer allocations and page faults in eager mode).
    br, bc = spec.block_for(operand)
    b0, b1 = (bc, br) if colwise else (br, bc)
    pb = p.reshape(p.shape[0] // b0, b0, p.shape[1] // b1, b1)
    nb = None if noise is None else noise.reshape(pb.shape)
    block_amax = pb.abs().amax(dim=(1, 3), keepdim=True)  # NaN propagates
    finite = torch.isfinite(block_amax)
    nan = float("nan")

    if spec.scaling is Scaling.BLOCK_POW2:
        scale, scale_inv = _pow2_block_scales(block_amax, elem)
        y = round_to_element(pb * scale, elem, nb).mul_(scale_inv)

    elif spec.scaling is Scaling.BLOCK_E8M0:
        # Decode scale 2**k with k from the exponent bits of the block amax (exact, no log2 rounding).
        k = _floor_log2(block_amax) - elem.emax  # OCP MX: floor(log2 amax) - emax_elem
        if spec.e8m0_round_up:
            # smallest k with amax <= max * 2**k: one more when amax's mantissa exceeds max's
            k = k + (_mantissa_bits(block_amax) > _MAX_MANTISSA_BITS[elem.name]).to(k.dtype)
        k = k.clamp(-127, 127)  # the E8M0 range
        scale_inv = torch.where(finite, _exp2i(k), torch.full_like(block_amax, nan))
        y = round_to_element(pb * _exp2i(-k), elem, nb).mul_(scale_inv)

    elif spec.scaling is Scaling.BLOCK_E4M3_TENSOR:
        # NVFP4 as in TE's NVFP4BlockScaling reference: an FP32 tensor scale maps
        # the tensor amax to 448*6; each block's decode scale is stored in E4M3.
        # The local tensor amax is the max of the block amaxes (exact; NaN propagates):
        # one pass over the operand fewer than tensor_amax(p).
        a = block_amax.amax() if amax is None else amax
        s_enc, s_dec = _nvfp4_tensor_scales(a)
        s_block = round_e4m3((block_amax * (s_enc * _RCP_E2M1_MAX)).clamp(max=_F32_MAX))
        enc = (1.0 / (s_block * s_dec)).clamp(max=_F32_MAX)  # zero block -> largest float; x = 0 stays 0
        s_block = torch.where(finite & torch.isfinite(a), s_block, torch.full_like(s_block, nan))
        # clamp before rounding: a block whose E4M3 scale underflowed to 0 must give 0, not Inf * 0
        q = round_to_element((pb * enc).clamp_(-elem.max, elem.max), elem, nb)
        y = q.mul_(s_block).mul_(s_dec)  # q * s_block is exact; one rounding by the tensor scale

    elif spec.scaling is Scaling.BLOCK_FP32:
        # fp4_block (the SNIP paper's FP4): the stored FP32 scale s = amax / max (correctly
        # rounded on every device: _div_rn, not ``/ elem.max``); elements are x / s rounded,
        # dequantized as q * s. A zero block keeps s = 1, and so does a block of fp32 subnormals
        # whose amax / max underflows to 0 (trained models' gradients have them): x / 0 would be
        # NaN, while with s = 1 every |x| < 2**-126 rounds to 0, the nearest representable value.
        s = _div_rn(block_amax, elem.max)
        s = torch.where((block_amax == 0) | (s == 0), torch.ones_like(s), s)
        s = torch.where(finite, s, torch.full_like(s, nan))  # NaN/Inf in a block poisons the block
        y = round_to_element(pb / s, elem, nb).mul_(s)

    else:  # pragma: no cover - every Scaling is handled above
        raise AssertionError(spec.scaling)
    return y.reshape(p.shape)
