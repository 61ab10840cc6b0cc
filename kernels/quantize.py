"""Fused quantize-dequantize Triton kernels, bit-identical to ``megatron_snip.precision.quantize``.

One kernel, specialized by constexprs per format / operand kind / layout, runs the block
scaling of ``quantize.blocks._qdq`` for every scaling rule: per tensor (``fp8``; the
0-d scales come from the reference's own ``_tensor_scales``), power-of-two blocks
(``fp8_block``), E8M0 blocks (``mxfp8``, ``mxfp4``) and E4M3 blocks under an FP32 tensor
scale (``nvfp4``, its tensor scales from the reference's ``_nvfp4_tensor_scales``), with
stochastic rounding from the same counter-based bits (``quantize.noise``) and the 16-point
random Hadamard transform (the same butterfly order as ``quantize.hadamard``).

Why the results are the reference's bits (and stay so compiled for a GPU):
  * every scale is a power of two built from exponent bits, or one correctly rounded
    division (``tl.div_rn``; Triton's ``/`` is approximate on GPUs);
  * block amaxes are taken as int32 maxima of the sign-cleared bit patterns: for
    non-negative floats that order is the float order, and NaN (above Inf) propagates,
    as torch's amax does (``tl.max`` on floats may drop NaN);
  * round-to-nearest-even is the 2**23 add-subtract (libdevice.rint has no interpreter
    implementation); it is exact for 0 <= v < 2**23 and larger v saturate anyway;
  * launches pass ``enable_fp_fusion=False`` (no FMA contraction of the reference's
    separate multiplies and adds) and the code uses no approximate math.
Tested bitwise against the reference under ``TRITON_INTERPRET=1`` on CPU
(tests/unit/test_kernels.py) and on CUDA by scripts/gpu_check.sh; written for Triton 3.6+
(only ``tl.reshape/permute/split/join``, bitcasts and ``tl.div_rn``).

Layout: the kernel addresses the logical (rows, cols) operand through strides, so a
transposed view (the wgrad operands) is read and written in its physical layout, like the
reference's colwise path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_snip.precision.formats import E4M3, Format, Operand, Scaling, get_format
from megatron_snip.precision.quantize.bits import _F32_MAX
from megatron_snip.precision.quantize.blocks import (
    _MAX_MANTISSA_BITS,
    _RCP_E2M1_MAX,
    _nvfp4_tensor_scales,
    _tensor_scales,
)
from megatron_snip.precision.quantize.hadamard import RHT_SIGNS, RHT_SIZE
from megatron_snip.precision.quantize.noise import _MIX_MUL1, _MIX_MUL2

__all__ = ["qdq", "scaled_operand"]

_SCALING_CODE = {Scaling.NONE: 0, Scaling.TENSOR: 1, Scaling.BLOCK_POW2: 2, Scaling.BLOCK_E8M0: 3,
                 Scaling.BLOCK_E4M3_TENSOR: 4, Scaling.BLOCK_FP32: 5}
_RHT_NEG_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)  # bit i set: sign i is -1
_MUL1 = tl.constexpr(_MIX_MUL1)  # the counter RNG's mixer constants, from quantize.noise
_MUL2 = tl.constexpr(_MIX_MUL2)
_IDENTITY = get_format("bf16")


@triton.jit
def _exp2i(k):
    """2**k (fp32) for int32 k in [-127, 127], from exponent bits (2**-127 is the one subnormal)."""
    bits = tl.where(k >= -126, (k + 127) << 23, 1 << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(a):
    """floor(log2 a) for fp32 a >= 0 from its exponent bits (-127 for 0/subnormals, 128 for Inf/NaN)."""
    return (a.to(tl.int32, bitcast=True) >> 23) - 127


@triton.jit
def _is_finite(a):
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) != 0xFF


@triton.jit
def _clamp_max(v, hi):
    return tl.where(v > hi, hi, v)  # NaN > hi is False: NaN stays


@triton.jit
def _round_element(x, noise, EMIN: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr,
                   SR: tl.constexpr):
    """``rounding._round_arith``: RNE (or SR with uniform ``noise``) onto the element grid, saturating."""
    a = tl.abs(x)
    e = tl.minimum(tl.maximum(_floor_log2(a), EMIN), EMAX)
    v = a * _exp2i(MBITS - e)  # exact: a power-of-two scaling
    if SR:
        r = tl.floor(v)
        r = r + tl.where(noise < v - r, 1.0, 0.0)
    else:
        big = v >= 8388608.0
        r = tl.where(big, v, (v + 8388608.0) - 8388608.0)  # ties to even below 2**23
    y = _clamp_max(r * _exp2i(e - MBITS), MAXV)
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31  # the sign bit alone
    return (y.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _mix32(h):
    """``noise._mix32`` on int32 bit patterns (multiplication wraps; shifts made logical by masks)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MUL1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _MUL2
    return h ^ ((h >> 15) & 0x1FFFF)


@triton.jit
def _butterfly(v, TR: tl.constexpr, NB: tl.constexpr, H: tl.constexpr):
    """One Walsh-Hadamard stage on the last axis (16) of v [TR, NB, 16]: (v_i, v_i+H) -> (sum, difference)."""
    v = tl.reshape(v, [TR, NB, 16 // (2 * H), 2, H])
    v = tl.permute(v, [0, 1, 2, 4, 3])
    lo, hi = tl.split(v)
    v = tl.join(lo + hi, lo - hi)
    v = tl.permute(v, [0, 1, 2, 4, 3])
    return tl.reshape(v, [TR, NB, 16])


@triton.jit
def _qdq_kernel(
    x_ptr, y_ptr, scalars_ptr, seeds_ptr, s_ptr,
    rows, cols, stride_r, stride_c,
    TR: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr, BLOCK_2D: tl.constexpr,
    SCALING: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr,
    ROUND_UP: tl.constexpr, MAX_MANT: tl.constexpr, SR: tl.constexpr, HADAMARD: tl.constexpr,
    RHT_NEG: tl.constexpr, F32MAX: tl.constexpr, OUT_ELEMENTS: tl.constexpr,
):
    """Quantize-dequantize one [TR rows] x [NB blocks of BS columns] tile of the logical operand.

    SCALING: 0 none (Hadamard only), 1 tensor (scalars = scale, scale_inv), 2 pow2 blocks,
    3 E8M0 blocks, 4 NVFP4 (scalars = s_enc * fl32(1/6), s_dec, tensor amax), 5 FP32 block
    scales amax / max (fp4_block).
    BLOCK_2D: a block spans all TR rows (2-D weight blocks, TR = block rows).
    OUT_ELEMENTS (SCALING 1, 2): store the on-grid elements (before the decode scale) into
    y_ptr, a row-major (rows, cols) float8 tensor, and the block decode scales into s_ptr
    (row-major (rows / block rows, cols / BS)) - the operands of a scaled-mm.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * TR + tl.arange(0, TR)
    c = pid_c * (NB * BS) + tl.arange(0, NB)[:, None] * BS + tl.arange(0, BS)[None, :]  # [NB, BS]
    r3 = r[:, None, None]
    c3 = c[None, :, :]
    mask = (r3 < rows) & (c3 < cols)
    offs = r3.to(tl.int64) * stride_r + c3.to(tl.int64) * stride_c
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # bf16 -> fp32 is exact

    if HADAMARD:  # x · diag(s) · H16 / 4 along each 16-block (BS == 16), the reference's order
        idx = tl.arange(0, 16)
        neg = ((RHT_NEG >> idx) & 1) == 1
        x = tl.where(neg[None, None, :], -x, x)
        x = _butterfly(x, TR, NB, 8)
        x = _butterfly(x, TR, NB, 4)
        x = _butterfly(x, TR, NB, 2)
        x = _butterfly(x, TR, NB, 1)
        x = x * 0.25

    if SR:
        seed0 = tl.load(seeds_ptr)
        seed1 = tl.load(seeds_ptr + 1)
        counter = r3 * cols + c3  # int32, wraps like the reference's counters
        h = _mix32(counter + seed0)
        h = _mix32(h ^ seed1)
        noise = ((h >> 8) & 0xFFFFFF).to(tl.float32) * (2.0 ** -24)
    else:
        noise = x  # unused

    if SCALING == 0:
        y = x
    elif SCALING == 1:
        scale = tl.load(scalars_ptr)
        scale_inv = tl.load(scalars_ptr + 1)
        y = _round_element(x * scale, noise, EMIN, EMAX, MBITS, MAXV, SR)
        if not OUT_ELEMENTS:
            y = y * scale_inv
    else:
        # block amax as the int32 max of |x|'s bit patterns: NaN-propagating, exact
        bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)  # [TR, NB]
        if BLOCK_2D:
            bits = tl.max(bits, axis=0)[None, :]  # [1, NB]
        amax = bits.to(tl.float32, bitcast=True)[:, :, None]  # [TR or 1, NB, 1]
        finite = _is_finite(amax)
        if SCALING == 2:
            k = _floor_log2(tl.div_rn(tl.full(amax.shape, MAXV, tl.float32), amax))
            k = tl.minimum(tl.maximum(k, -127), 127)
            k = tl.where(amax == 0.0, 0, k)
            scale_inv = tl.where(finite, _exp2i(-k), float("nan"))
            y = _round_element(x * _exp2i(k), noise, EMIN, EMAX, MBITS, MAXV, SR)
            if OUT_ELEMENTS:
                blk = pid_c * NB + tl.arange(0, NB)
                if BLOCK_2D:
                    s_offs = pid_r * (cols // BS) + blk[None, :]
                    s_mask = blk[None, :] < cols // BS
                else:
                    s_offs = r[:, None] * (cols // BS) + blk[None, :]
                    s_mask = (r[:, None] < rows) & (blk[None, :] < cols // BS)
                tl.store(s_ptr + s_offs, tl.reshape(scale_inv, [scale_inv.shape[0], NB]), mask=s_mask)
            else:
                y = y * scale_inv
        elif SCALING == 3:
            k = _floor_log2(amax) - EMAX
            if ROUND_UP:
                k = k + tl.where((amax.to(tl.int32, bitcast=True) & 0x7FFFFF) > MAX_MANT, 1, 0)
            k = tl.minimum(tl.maximum(k, -127), 127)
            scale_inv = tl.where(finite, _exp2i(k), float("nan"))
            y = _round_element(x * _exp2i(-k), noise, EMIN, EMAX, MBITS, MAXV, SR) * scale_inv
        elif SCALING == 5:  # s = fl32(amax / max), correctly rounded; x / s rounded, times s
            s = tl.div_rn(amax, tl.full(amax.shape, MAXV, tl.float32))
            s = tl.where((amax == 0.0) | (s == 0.0), 1.0, s)  # zero block, or amax / max underflowed: 0s
            s = tl.where(finite, s, float("nan"))
            s = tl.broadcast_to(s, x.shape)
            y = _round_element(tl.div_rn(x, s), noise, EMIN, EMAX, MBITS, MAXV, SR) * s
        else:
            s_mul = tl.load(scalars_ptr)
            s_dec = tl.load(scalars_ptr + 1)
            t_amax = tl.load(scalars_ptr + 2)
            s_block = _round_element(_clamp_max(amax * s_mul, F32MAX), amax, -6, 8, 3, 448.0, False)  # E4M3
            enc = _clamp_max(tl.div_rn(tl.full(s_block.shape, 1.0, tl.float32), s_block * s_dec), F32MAX)
            s_block = tl.where(finite & _is_finite(t_amax), s_block, float("nan"))
            v = x * enc
            v = tl.where(v > MAXV, MAXV, tl.where(v < -MAXV, -MAXV, v))  # clamp, NaN kept
            y = _round_element(v, noise, EMIN, EMAX, MBITS, MAXV, SR) * s_block * s_dec
    if OUT_ELEMENTS:  # logical row-major, whatever the input layout (scaled-mm wants that)
        tl.store(y_ptr + r3.to(tl.int64) * cols + c3, y, mask=mask)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


def _tile(spec: Format, operand: Operand, hadamard: bool) -> tuple[int, int, int, bool]:
    """(TR, NB, BS, BLOCK_2D): rows per tile, blocks per tile row, block columns, 2-D blocks."""
    if spec.scaling in (Scaling.NONE, Scaling.TENSOR):
        return 16, 8 if hadamard else 1, RHT_SIZE if hadamard else 128, False
    br, bc = spec.block_for(operand)
    nb = max(1, 128 // bc)
    return (br, nb, bc, True) if br > 1 else (16, nb, bc, False)


def qdq(p: torch.Tensor, spec: Format, operand: Operand, hadamard: bool, colwise: bool,
        amax: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor:
    """``quantize.blocks._qdq`` as one fused Triton kernel (same arguments, same bits).

    Args:
        p: contiguous fp32 physical tensor: the logical operand (``colwise=False``) or its
            transpose (``colwise=True``); a CUDA tensor (or CPU under TRITON_INTERPRET=1).
        amax: tensor amax (of the rotated operand), or None for the local one.
        seeds: int32 (2,) stochastic-rounding seeds on p's device, or None for RNE.
    Returns:
        the dequantized (and, with ``hadamard``, rotated) operand in p's layout.
    """
    assert p.dtype == torch.float32 and p.is_contiguous() and p.dim() == 2
    rows, cols = (p.shape[1], p.shape[0]) if colwise else (p.shape[0], p.shape[1])
    stride_r, stride_c = (1, p.shape[1]) if colwise else (p.shape[1], 1)
    if hadamard and spec.quantizes and (
            (spec.uses_tensor_amax and amax is None) or _tile(spec, operand, True)[2] != RHT_SIZE):
        # Rotate in a pass of its own (the same butterflies) when the tensor scale needs the
        # rotated tensor's amax first, or the format's blocks are not the 16-blocks rotated in-tile.
        p = qdq(p, _IDENTITY, operand, True, colwise, None, None)
        hadamard = False
    elem = spec.element_for(operand) if spec.quantizes else E4M3  # E4M3: placeholder constants for NONE
    scalars = torch.zeros(4, dtype=torch.float32, device=p.device)
    if spec.scaling is Scaling.TENSOR:
        scale, scale_inv = _tensor_scales(p.abs().amax() if amax is None else amax, elem)
        scalars[0], scalars[1] = scale, scale_inv
    elif spec.scaling is Scaling.BLOCK_E4M3_TENSOR:
        a = p.abs().amax() if amax is None else amax  # = the max of the block amaxes
        s_enc, s_dec = _nvfp4_tensor_scales(a)
        scalars[0], scalars[1], scalars[2] = s_enc * _RCP_E2M1_MAX, s_dec, a
    tr, nb, bs, block_2d = _tile(spec, operand, hadamard)
    y = torch.empty_like(p)
    _launch(p, y, scalars, seeds, scalars, rows, cols, stride_r, stride_c, spec, elem, tr, nb, bs, block_2d,
            hadamard, out_elements=False)
    return y


def _launch(x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c, spec, elem, tr, nb, bs, block_2d,
            hadamard, out_elements) -> None:
    grid = (triton.cdiv(rows, tr), triton.cdiv(cols, nb * bs))
    _qdq_kernel[grid](
        x, y, scalars, seeds if seeds is not None else scalars, scales_out, rows, cols, stride_r, stride_c,
        TR=tr, NB=nb, BS=bs, BLOCK_2D=block_2d, SCALING=_SCALING_CODE[spec.scaling],
        EMIN=elem.emin, EMAX=elem.emax, MBITS=elem.mbits, MAXV=elem.max,
        ROUND_UP=bool(spec.e8m0_round_up), MAX_MANT=_MAX_MANTISSA_BITS[elem.name],
        SR=seeds is not None, HADAMARD=hadamard, RHT_NEG=_RHT_NEG_MASK, F32MAX=_F32_MAX,
        OUT_ELEMENTS=out_elements, enable_fp_fusion=False,
    )


_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def scaled_operand(x: torch.Tensor, spec: Format, operand: Operand,
                   amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize.blocks.scaled_elements`` + the float8 cast in one pass: a scaled-mm's operand.

    Args:
        x: (rows, cols) logical operand, any float dtype, any strides (a transposed view is
            read in place); reduction dim last.
        spec: ``fp8`` (per-tensor scales) or ``fp8_block`` (power-of-two blocks).
        amax: tensor amax reduced over TP, or None for the local one (``fp8`` only).
    Returns:
        (elements: row-major (rows, cols) float8, decode scales: fp32 0-d or
         (rows / br, cols / bc)) - the values ``scaled_elements`` returns, bit for bit.
    """
    assert spec.scaling in (Scaling.TENSOR, Scaling.BLOCK_POW2) and x.dim() == 2
    elem = spec.element_for(operand)
    rows, cols = x.shape
    scalars = torch.zeros(4, dtype=torch.float32, device=x.device)
    if spec.scaling is Scaling.TENSOR:
        scale, scale_inv = _tensor_scales(x.abs().amax().float() if amax is None else amax, elem)
        scalars[0], scalars[1] = scale, scale_inv
        scales_out = scale_inv
    else:
        br, bc = spec.block_for(operand)
        scales_out = torch.empty(rows // br, cols // bc, dtype=torch.float32, device=x.device)
    tr, nb, bs, block_2d = _tile(spec, operand, False)
    elements = torch.empty(rows, cols, dtype=_FLOAT8[elem.name], device=x.device)
    _launch(x, elements, scalars, None, scales_out, rows, cols, x.stride(0), x.stride(1), spec, elem, tr, nb, bs,
            block_2d, False, out_elements=True)
    return elements, scales_out
