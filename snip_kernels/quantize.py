"""Fused quantize-dequantize Triton kernels, bit-identical to ``megatron_snip.precision.quantize``.

One kernel, specialized by constexprs per format / operand kind / layout, runs the block
scaling of ``quantize.blocks._qdq`` for every scaling rule: per tensor (``fp8``; the
0-d scales derived in the kernel from the tensor amax as ``_tensor_scales`` does), power-of-two
blocks (``fp8_block``), E8M0 blocks (``mxfp8``, ``mxfp4``) and E4M3 blocks under an FP32 tensor
scale (``nvfp4``, its tensor scales as ``_nvfp4_tensor_scales``), with
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

Memory traffic, per element of the operand (input of b bytes: 4 fp32, 2 bf16 - read as stored and
widened in registers): one read (b) and one write - the dequantized fp32 value (4), or for a
scaled-mm operand the float8 code (1) plus its block's share of one fp32 scale (4/128 for 1x128,
4/16384 for 128x128). The 16-point RHT runs on the tile in registers for every block width (the
tile's columns regrouped by 16), so it adds no pass; a tensor amax of the rotated operand comes
from the amax-only mode (SCALING 6: one more read of b, no write but one fp32 per program). The
caller's accounting, with the derivation: ``precision/quantize/kernel_calls.bytes_moved``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["launch_grid", "launch_qdq", "num_warps_for"]


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
def _mix32(h, MUL1: tl.constexpr, MUL2: tl.constexpr):
    """``noise._mix32`` on int32 bit patterns (multiplication wraps; shifts made logical by masks);
    MUL1, MUL2: its mixer constants (``noise._MIX_MUL1/2``)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * MUL1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * MUL2
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
    RHT_NEG: tl.constexpr, F32MAX: tl.constexpr, OUT_ELEMENTS: tl.constexpr, MUL1: tl.constexpr,
    MUL2: tl.constexpr, TMAX: tl.constexpr, RCP: tl.constexpr,
):
    """Quantize-dequantize one [TR rows] x [NB blocks of BS columns] tile of the logical operand.

    SCALING: 0 none (Hadamard only), 1 tensor, 2 pow2 blocks, 3 E8M0 blocks, 4 NVFP4 (E4M3 block
    scales under an FP32 tensor scale; TMAX = 448 * 6, RCP = fl32(1/6)), 5 FP32 block
    scales amax / max (fp4_block), 6 the tile's amax only (of the rotated tile with HADAMARD),
    stored as fp32 into s_ptr[pid_r * programs along cols + pid_c], no y written: the tensor
    amax of a rotated operand without writing the rotation out.
    BLOCK_2D: a block spans all TR rows (2-D weight blocks, TR = block rows).
    SCALING 1 and 4 read the tensor amax from scalars_ptr (one fp32) and derive the tensor scales
    here, as ``blocks._tensor_scales`` / ``_nvfp4_tensor_scales`` do (correctly rounded divisions,
    the same clamps), instead of a dozen one-element launches on the host side.
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

    if HADAMARD:  # x · diag(s) · H16 / 4 along each 16-column group of the tile, the reference's order
        # fused for every block width (BS a multiple of 16): the tile's columns regrouped by 16
        x = tl.reshape(x, [TR, NB * BS // 16, 16])
        idx = tl.arange(0, 16)
        neg = ((RHT_NEG >> idx) & 1) == 1
        x = tl.where(neg[None, None, :], -x, x)
        x = _butterfly(x, TR, NB * BS // 16, 8)
        x = _butterfly(x, TR, NB * BS // 16, 4)
        x = _butterfly(x, TR, NB * BS // 16, 2)
        x = _butterfly(x, TR, NB * BS // 16, 1)
        x = tl.reshape(x * 0.25, [TR, NB, BS])

    if SR:
        seed0 = tl.load(seeds_ptr)
        seed1 = tl.load(seeds_ptr + 1)
        counter = r3 * cols + c3  # int32, wraps like the reference's counters
        h = _mix32(counter + seed0, MUL1, MUL2)
        h = _mix32(h ^ seed1, MUL1, MUL2)
        noise = ((h >> 8) & 0xFFFFFF).to(tl.float32) * (2.0 ** -24)
    else:
        noise = x  # unused

    if SCALING == 6:  # the tile's amax only (of the rotated x with HADAMARD): no element is written
        bits = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=1)  # [TR]
        tile_amax = tl.max(bits, axis=0).to(tl.float32, bitcast=True)
        tl.store(s_ptr + pid_r * tl.num_programs(1) + pid_c, tile_amax)
    elif SCALING == 0:
        y = x
    elif SCALING == 1:
        one = tl.zeros([1, 1, 1], tl.int32)
        t_amax = tl.load(scalars_ptr + one)
        scale = _clamp_max(tl.div_rn(tl.full([1, 1, 1], MAXV, tl.float32), t_amax), F32MAX)  # fl(max / amax)
        scale = tl.where(t_amax == 0.0, 1.0, scale)  # an all-zero tensor
        scale_inv = tl.where(_is_finite(t_amax), tl.div_rn(tl.full([1, 1, 1], 1.0, tl.float32), scale), float("nan"))
        y = _round_element(x * scale, noise, EMIN, EMAX, MBITS, MAXV, SR)
        if OUT_ELEMENTS:
            tl.store(s_ptr + one, scale_inv, mask=(one + pid_r + pid_c) == 0)  # the 0-d decode scale, once
        else:
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
            t_amax = tl.load(scalars_ptr + tl.zeros([1, 1, 1], tl.int32))
            s_enc = _clamp_max(tl.div_rn(tl.full([1, 1, 1], TMAX, tl.float32), t_amax), F32MAX)
            s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)  # an infinite amax
            s_dec = tl.div_rn(tl.full([1, 1, 1], 1.0, tl.float32), s_enc)
            s_mul = s_enc * RCP  # TE folds the E2M1 reciprocal into the multiplier (an exact fp32 product rounded once)
            s_block = _round_element(_clamp_max(amax * s_mul, F32MAX), amax, -6, 8, 3, 448.0, False)  # E4M3
            enc = _clamp_max(tl.div_rn(tl.full(s_block.shape, 1.0, tl.float32), s_block * s_dec), F32MAX)
            s_block = tl.where(finite & _is_finite(t_amax), s_block, float("nan"))
            v = x * enc
            v = tl.where(v > MAXV, MAXV, tl.where(v < -MAXV, -MAXV, v))  # clamp, NaN kept
            y = _round_element(v, noise, EMIN, EMAX, MBITS, MAXV, SR) * s_block * s_dec
    if SCALING == 6:
        pass
    elif OUT_ELEMENTS:  # logical row-major, whatever the input layout (scaled-mm wants that)
        tl.store(y_ptr + r3.to(tl.int64) * cols + c3, y, mask=mask)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


def launch_grid(rows: int, cols: int, tr: int, nb: int, bs: int) -> tuple[int, int]:
    """The launch grid over a logical (rows, cols) operand: (row tiles, column tiles)."""
    return triton.cdiv(rows, tr), triton.cdiv(cols, nb * bs)


def num_warps_for(tr: int, nb: int, bs: int) -> int:
    """Warps per program for a tile of tr x nb x bs fp32 elements: at most 32 live fp32 elements per thread.

    A 1x128 tile (16 x 1 x 128 = 2K elements) at Triton's default 4 warps holds 16 per thread; a
    128x128 weight tile (16K) at 4 warps would hold 128 per thread, several live copies of which
    (x, its bit pattern, the scaled and rounded values) exceed the 255 registers a thread has and
    spill to local memory. 16K / (32 x 32) = 16 warps keeps 32 per thread. Clamped to [4, 16]."""
    return max(4, min(16, (tr * nb * bs) // (32 * 32)))


def launch_qdq(x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c, *, tr: int, nb: int, bs: int,
               block_2d: bool, scaling: int, emin: int, emax: int, mbits: int, maxv: float, round_up: bool,
               max_mant: int, hadamard: bool, rht_neg: int, f32max: float, mix_mul1: int, mix_mul2: int,
               out_elements: bool, tensor_max: float = 0.0, rcp_max: float = 0.0) -> None:
    """Launch ``_qdq_kernel`` over the logical (rows, cols) operand: tensors and plain constants only.

    The caller (``megatron_snip/precision/quantize/kernel_calls.py``) turns a format and operand
    kind into these: the tile (tr rows x nb blocks of bs columns, block_2d), the scaling code
    (``_qdq_kernel``'s SCALING), the element grid (emin, emax, mbits, maxv), E8M0 rounding
    (round_up, max_mant), the Hadamard sign mask (rht_neg: bit i set = sign i is -1), the fp32 max
    and the counter RNG's mixer constants; stochastic rounding runs when ``seeds`` is given; for a
    tensor scale ``scalars`` is the fp32 tensor amax (``tensor_max``, ``rcp_max``: NVFP4's 448 * 6 and
    fl32(1/6)) and, with ``out_elements``, the decode scale is written into ``scales_out`` (0-d). ``x`` may be
    fp32, bf16 or fp16 (loaded and widened in registers: no fp32 copy in memory). scaling=6 writes
    one fp32 amax per program into ``scales_out`` (``launch_grid`` programs, row-major)."""
    grid = launch_grid(rows, cols, tr, nb, bs)
    _qdq_kernel[grid](
        x, y, scalars, seeds if seeds is not None else scalars, scales_out, rows, cols, stride_r, stride_c,
        TR=tr, NB=nb, BS=bs, BLOCK_2D=block_2d, SCALING=scaling,
        EMIN=emin, EMAX=emax, MBITS=mbits, MAXV=maxv,
        ROUND_UP=round_up, MAX_MANT=max_mant,
        SR=seeds is not None, HADAMARD=hadamard, RHT_NEG=rht_neg, F32MAX=f32max,
        OUT_ELEMENTS=out_elements, MUL1=mix_mul1, MUL2=mix_mul2, TMAX=tensor_max, RCP=rcp_max, enable_fp_fusion=False,
        num_warps=num_warps_for(tr, nb, bs),
    )
