"""Reference quantize-dequantize (QDQ) functions for every format in ``formats.py``.

Everything here is a pure PyTorch function of its inputs: fp32 in, fp32 out,
vectorized over blocks (no Python loops over blocks), deterministic given a
``torch.Generator``. These functions are the specification that kernels and
backends are tested against (ARCHITECTURE.md, "Numerics conventions").

Layers:
  * element rounding - ``round_e4m3``, ``round_e5m2``, ``round_e2m1`` (RNE, or
    stochastic given uniform noise; saturating) and ``round_e8m0``;
  * ``hadamard_transform`` - the 16-point random Hadamard transform (RHT);
  * ``uniform_noise`` - counter-based uniform draws for stochastic rounding;
  * ``quantize(x, fmt, operand, ...)`` - block scaling + rounding + dequantize
    of one 2-D GEMM operand whose reduction dim is last.

Conventions shared by all quantizers:
  * Element rounders saturate: finite values beyond the max and +-Inf round to
    +-max; NaN stays NaN; -0.0 stays -0.0.
  * ``quantize`` never turns a non-finite input into a finite output silently:
    a block whose amax is NaN or Inf dequantizes to NaN in every element (for
    ``fp8`` the block is the whole tensor; for ``nvfp4`` a non-finite tensor
    amax also makes the whole tensor NaN). All-zero blocks give zeros (no 0/0).
  * Shapes: the reduction dim must be a multiple of the format's block (and,
    for 2-D weight blocks, the other dim too). Otherwise ``quantize`` raises a
    ValueError naming format, dimension and block. We do not pad: a zero-padded
    tail block would silently get numerics the hardware formats do not have,
    and Llama hidden sizes are multiples of 128 anyway.

Layouts: the math is defined on the logical (rows, cols) operand. A caller may
pass a transposed view (the wgrad operands dYᵀ and Xᵀ are exactly that); it is
then processed in its physical layout ("colwise": blocks run down the columns
of the contiguous tensor), which reads memory contiguously and gives bitwise
the same result as quantizing ``x.contiguous()``. The result comes back in the
same layout, so it may be a non-contiguous (transposed) view.

Speed (one CPU thread; ``scripts/bench_quant.py``): eager PyTorch runs each
quantizer as 10-40 elementwise passes over memory (0.02-0.15 Gelem/s; the eager
paths use in-place ops, float8 casts and a magic-number E2M1 rounding to keep
passes and page-faulting temporaries down). ``compiled=True`` runs the same
functions through ``torch.compile``: one fused, vectorized kernel per format /
operand kind / layout / shape (0.3-1.2 Gelem/s), bit-identical to eager except
NaN payloads, compiled on first use (2-5 s each, cached on disk by inductor).
If compilation fails it warns once and falls back to eager.
"""

from __future__ import annotations

import struct
import types
import warnings
from collections.abc import Callable

import torch

from megatron_snip.precision.formats import (
    E2M1,
    E4M3,
    E5M2,
    Element,
    Format,
    Operand,
    Scaling,
    get_format,
)

__all__ = [
    "RHT_SIGNS",
    "RHT_SIZE",
    "check_operand_shape",
    "compiled_quantizers_available",
    "draw_seeds",
    "hadamard_transform",
    "quantize",
    "rht_matrix",
    "round_e2m1",
    "round_e4m3",
    "round_e5m2",
    "round_e8m0",
    "round_to_element",
    "tensor_amax",
    "uniform_noise",
]

_F32_MAX = torch.finfo(torch.float32).max
_NVFP4_TENSOR_MAX = E4M3.max * E2M1.max  # 448 * 6: the NVFP4 tensor scale maps the tensor amax here


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


# fl32(1/6): TE folds the E2M1 reciprocal into the tensor-scale multiplier; we round it the same way.
_RCP_E2M1_MAX = struct.unpack("<f", struct.pack("<f", 1.0 / E2M1.max))[0]
# Fraction bits of each element's max (448 = 1.75 * 2**8 -> 0x600000). Precomputed:
# torch.compile cannot trace ``struct``.
_MAX_MANTISSA_BITS = {e.name: _f32_bits(e.max) & 0x7FFFFF for e in (E4M3, E5M2, E2M1)}


# --------------------------------------------------------------------------- #
# exact power-of-two helpers (bit manipulation: no libm, identical when compiled)
# --------------------------------------------------------------------------- #
def _exp2i(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32, exactly, for an int32 tensor k in [-127, 127].

    Built from the exponent bits; k = -127 is the one fp32 subnormal we need
    (the smallest E8M0 scale).
    """
    normal = (k + 127) << 23
    subnormal = torch.full_like(k, 1 << 22)  # bit pattern of 2**-127
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _rdiv(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t as one correctly rounded fp32 division (TE's ``max / amax``).

    ``c / t`` on a tensor means ``reciprocal(t) * c`` in PyTorch (eager and
    inductor alike), which can differ by an ulp.
    """
    return torch.div(torch.full_like(t, c), t)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) (int32) of a non-negative fp32 tensor, from its exponent bits.

    Exact for normal numbers; gives -127 for 0 and fp32 subnormals and 128 for
    Inf/NaN (callers clamp or mask these).
    """
    return (a.view(torch.int32) >> 23) - 127


def _mantissa_bits(a: torch.Tensor) -> torch.Tensor:
    """The 23 fraction bits (int32) of a non-negative fp32 tensor."""
    return a.view(torch.int32) & 0x7FFFFF


# --------------------------------------------------------------------------- #
# element rounding
# --------------------------------------------------------------------------- #
_MAX_BINADES_BY_COMPARISON = 3


def round_to_element(x: torch.Tensor, elem: Element, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to the grid of ``elem`` (values returned in fp32).

    Args:
        x: fp32 tensor, any shape.
        elem: the element grid (E4M3, E5M2, E2M1).
        noise: None for round-to-nearest-even; otherwise uniform [0, 1) draws
            broadcastable to ``x`` for stochastic rounding: a value a fraction p
            of the way from grid point lo to hi rounds to hi iff noise < p, so
            E[result] = x for |x| <= max.

    Finite values beyond ``elem.max`` and +-Inf saturate to +-max; NaN stays NaN.

    Several implementations with identical results (tested exhaustively against
    ml_dtypes, and eager against compiled): in eager mode, where every elementwise
    op is a pass over memory, RNE to E4M3/E5M2 goes through PyTorch's float8 casts
    (3 passes instead of ~20) and RNE to E2M1 through ``_round_e2m1_magic`` (9
    instead of 13). Stochastic rounding, and anything torch.compile traces, use the
    arithmetic below, which inductor fuses into one vectorized loop (faster there
    than its float8 casts).
    """
    if noise is None and not torch.compiler.is_compiling():
        if elem.name in _FLOAT8_DTYPES:
            return _round_float8_cast(x, elem)
        if elem.name == "e2m1":
            return _round_e2m1_magic(x)
    return _round_arith(x, elem, noise)


def _round_arith(x: torch.Tensor, elem: Element, noise: torch.Tensor | None) -> torch.Tensor:
    """``round_to_element`` by fp32 arithmetic: any element, RNE or stochastic; what torch.compile traces.

    In-place ops on its own temporaries: in eager mode every full-size temporary is an
    allocation whose pages fault in on first touch (more time than the op itself for
    large operands); torch.compile sees the same dataflow either way.
    """
    a = x.abs()
    # The grid spacing around a is q = 2**(e - mbits) with e = floor(log2 a), held
    # at emin below the normal range (subnormals) and at emax above it (the
    # result is clamped to max anyway; this keeps Inf/NaN from overflowing e).
    if elem.emax - elem.emin <= _MAX_BINADES_BY_COMPARISON:
        # Few binades (E2M1: 3): pick 1/q and q by comparisons. Same values as the
        # exponent-bit path below, ~25% faster compiled (no per-element bit casts);
        # q is not computed as 1 / inv_q: a division per element costs more.
        inv_q = torch.full_like(a, 2.0 ** (elem.mbits - elem.emin))
        q = torch.full_like(a, 2.0 ** (elem.emin - elem.mbits))
        for e in range(elem.emin + 1, elem.emax + 1):
            ge = a >= 2.0**e
            inv_q.masked_fill_(ge, 2.0 ** (elem.mbits - e))
            q.masked_fill_(ge, 2.0 ** (e - elem.mbits))
    else:
        e = _floor_log2(a).clamp_(elem.emin, elem.emax)
        inv_q, q = _exp2i(elem.mbits - e), _exp2i(e - elem.mbits)
    v = a.mul_(inv_q)  # exact: scaling by a power of two
    if noise is None:
        r = v.round_()  # round half to even
    else:
        r = torch.floor(v)
        r += noise < v.sub_(r)  # round up iff noise < v - r (exact); r >= 0, so r + 0 is r
    return r.mul_(q).clamp_(max=elem.max).copysign_(x)  # clamp keeps NaN


_FLOAT8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_E4M3_DECODE: dict[torch.device, torch.Tensor] = {}  # the 256 float8_e4m3fn codes as fp32, per device


def _round_float8_cast(x: torch.Tensor, elem: Element) -> torch.Tensor:
    """RNE to ``elem`` through PyTorch's float8 cast (eager only; see ``round_to_element``).

    Clamping first makes it saturating on every device (the E5M2 cast overflows to
    Inf) and keeps NaN and -0.0. Decoding E4M3 through a 256-entry table is ~2x
    faster on CPU than PyTorch's float8_e4m3fn -> float32 conversion.
    """
    f8 = x.clamp(-elem.max, elem.max).to(_FLOAT8_DTYPES[elem.name])
    if elem.name != "e4m3":
        return f8.to(x.dtype)
    table = _E4M3_DECODE.get(f8.device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        table = _E4M3_DECODE[f8.device] = codes.to(torch.float32).to(f8.device)
    return torch.take(table, f8.view(torch.uint8).long()).to(x.dtype)


def _round_e2m1_magic(x: torch.Tensor) -> torch.Tensor:
    """RNE to E2M1 in 9 elementwise passes instead of 13 (eager only; see ``round_to_element``).

    With c = 2**22, 2**23 or 2**24 for |x| below 2, below 4, or above, the fp32 sum
    |x| + c (|x| < 8) lies in [c, 2c), where floats are spaced 2**(e - mbits) = 0.5,
    1, 2 - the E2M1 spacing of |x|'s binade - so it rounds |x| to the E2M1 grid, ties
    to an even multiple (= even E2M1 code), and subtracting c is exact. Left to a
    compiler, the add-subtract pair could be folded away under fast-math: eager only.
    """
    a = x.abs()
    c = torch.where(a >= 2.0, torch.where(a >= 4.0, 2.0**24, 2.0**23), 2.0**22)
    # clamp keeps NaN; |x| >= 8 (Inf too) gives a sum >= 8, clamped to max
    return a.add_(c).sub_(c).clamp_(max=E2M1.max).copysign_(x)


def round_e4m3(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round to FP8 E4M3 (OCP ``float8_e4m3fn``: max 448, subnormals down to 2**-9)."""
    return round_to_element(x, E4M3, noise)


def round_e5m2(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round to FP8 E5M2 (max 57344, subnormals down to 2**-16); saturating (no Inf output)."""
    return round_to_element(x, E5M2, noise)


def round_e2m1(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round to FP4 E2M1: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    return round_to_element(x, E2M1, noise)


def round_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to E8M0 (``float8_e8m0fnu``): the powers of two 2**-127 .. 2**127.

    A value between 2**k and 2**(k+1) goes to the nearer one; the midpoint
    1.5 * 2**k goes up, as ml_dtypes does (with no mantissa bits, "ties to
    even" has no even digit to choose). Saturating: values beyond 2**127 and
    +Inf give 2**127; +-0 and positive values below 2**-127 give 2**-127 (E8M0
    has no zero). Negative values and NaN give NaN (E8M0 has no sign).
    The quantizers compute their scale exponents exactly and do not use this;
    it is here for tests and kernels.
    """
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1); handles fp32 subnormals
    k = (e - 1 + (m >= 0.75).to(e.dtype)).clamp(-127, 127).to(torch.int32)
    y = _exp2i(k)
    y = torch.where(x == 0, torch.full_like(y, 2.0**-127), y)
    y = torch.where(x == float("inf"), torch.full_like(y, 2.0**127), y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, float("nan")), y)


# --------------------------------------------------------------------------- #
# random Hadamard transform
# --------------------------------------------------------------------------- #
# Transformer Engine's fixed wgrad sign vector (NVFP4 recipe), so our RHT matches TE's.
RHT_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
RHT_SIZE = 16


def rht_matrix(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16x16 orthogonal matrix H = diag(RHT_SIGNS) · H16 / 4 (H16: Sylvester Hadamard, entries +-1)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < RHT_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64)
    return (signs[:, None] * h / RHT_SIZE**0.5).to(dtype=dtype, device=device)


def _rht_blocks(y3: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Apply H (or Hᵀ) along dim 1 of y3 (A, 16, B): H = diag(s) · H16 / 4.

    H16 is applied as a fast Walsh-Hadamard transform: four butterfly stages on
    the 16 slices y3[:, i] (pairs i, i+h for h = 8, 4, 2, 1), a fixed operation
    order that eager PyTorch and inductor reproduce bit for bit, in either
    memory layout. Sign flips and the 1/4 are exact.
    """
    # x · diag(s) first (exact sign flips, no pass for the +1s); the inverse applies s
    # last (Hᵀ = H16 · diag(s) / 4).
    v = [y3[:, i] if inverse or s > 0 else -y3[:, i] for i, s in enumerate(RHT_SIGNS)]
    for h in (8, 4, 2, 1):
        nxt = list(v)
        for i in range(RHT_SIZE):
            if not i & h:
                nxt[i], nxt[i + h] = v[i] + v[i + h], v[i] - v[i + h]
        v = nxt
    out = torch.stack(v, dim=1).mul_(0.25)
    if inverse:
        out.mul_(torch.tensor(RHT_SIGNS, dtype=out.dtype, device=out.device)[None, :, None])
    return out


def _rht_physical(p: torch.Tensor, colwise: bool, inverse: bool = False) -> torch.Tensor:
    """RHT along the logical last dim of a physical tensor (see ``_qdq`` for layouts)."""
    if colwise:  # p is (C, R): logical columns are physical rows
        return _rht_blocks(p.reshape(p.shape[0] // RHT_SIZE, RHT_SIZE, p.shape[1]), inverse).reshape(p.shape)
    return _rht_blocks(p.reshape(-1, RHT_SIZE, 1), inverse).reshape(p.shape)


def hadamard_transform(x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """x · H (``inverse=True``: x · Hᵀ = x · H⁻¹) along the last dim, in independent 16-blocks.

    Args:
        x: fp32 (..., C) with C a multiple of 16.
    Returns:
        fp32 tensor of x's shape. H = ``rht_matrix()`` is orthogonal, so
        rotating both operands of a GEMM along its reduction dim leaves the
        product unchanged: (A·H)(B·H)ᵀ = A·Bᵀ.
    """
    if x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"hadamard_transform: last dim {x.shape[-1]} is not a multiple of the {RHT_SIZE}-point transform"
        )
    return _rht_physical(x.contiguous(), colwise=False, inverse=inverse)


# --------------------------------------------------------------------------- #
# counter-based uniform noise for stochastic rounding
# --------------------------------------------------------------------------- #
# A 2-round 32-bit integer mixer (C. Wellons' hash-prospector, shifts 16/15/15),
# on int32 tensors holding uint32 bit patterns: multiplication wraps mod 2**32
# (two's complement; every PyTorch backend and Triton do this), right shifts are
# made logical by masking. The values are pinned by a golden test against
# pure-Python integer arithmetic, so a platform that behaved otherwise would fail
# loudly. (int64 arithmetic would avoid relying on wrap-around but is 2x slower.)
_MIX_MUL1, _MIX_MUL2 = 0x21F0AAAD, 0x735A2D97


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MIX_MUL1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _MIX_MUL2
    return h ^ ((h >> 15) & 0x1FFFF)


def _mix32_(h: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``_mix32`` in place on ``h`` with one scratch tensor: the same values without the ~10
    full-size temporaries eager mode would allocate (2x faster there; compiled code is fused
    either way, so torch.compile traces the functional version)."""
    for shift, mask, mul in ((16, 0xFFFF, _MIX_MUL1), (15, 0x1FFFF, _MIX_MUL2), (15, 0x1FFFF, None)):
        torch.bitwise_right_shift(h, shift, out=tmp)
        h ^= tmp.bitwise_and_(mask)
        if mul is not None:
            h *= mul
    return h


def _uniform_from_counter(counter: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) fp32 (24 random bits) from int32 counters and two int32 seeds (uint32 bit patterns)."""
    if torch.compiler.is_compiling():
        h = _mix32(counter + seeds[0])
        h = _mix32(h ^ seeds[1])
        return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (2.0**-24)
    h = counter + seeds[0]
    tmp = torch.empty_like(h)
    _mix32_(h, tmp)
    h ^= seeds[1]
    _mix32_(h, tmp)
    h >>= 8
    u = tmp.view(torch.float32)  # the scratch, reused for the result
    return u.copy_(h.bitwise_and_(0xFFFFFF)).mul_(2.0**-24)


def draw_seeds(generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """Two 32-bit seeds (an int32 tensor on ``device``) drawn from ``generator`` (None: torch's default)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    seeds = torch.randint(-(2**31), 2**31, (2,), generator=generator, dtype=torch.int32, device=gen_device)
    return seeds.to(device)


def _noise_physical(rows: int, cols: int, colwise: bool, seeds: torch.Tensor) -> torch.Tensor:
    """Noise for the logical (rows, cols) operand, laid out like its physical tensor.

    Element (i, j) of the logical operand always gets counter i * cols + j
    (mod 2**32), so the draws do not depend on the memory layout.
    """
    r = torch.arange(rows, dtype=torch.int32, device=seeds.device) * cols
    c = torch.arange(cols, dtype=torch.int32, device=seeds.device)
    counter = (c[:, None] + r[None, :]) if colwise else (r[:, None] + c[None, :])
    return _uniform_from_counter(counter, seeds)


def uniform_noise(rows: int, cols: int, seeds: torch.Tensor) -> torch.Tensor:
    """The (rows, cols) uniform [0, 1) draws ``quantize`` uses for stochastic rounding with ``seeds``."""
    if rows * cols > 2**32:
        raise ValueError(f"uniform_noise: {rows}x{cols} operand has more than 2**32 elements (counter overflow)")
    return _noise_physical(rows, cols, False, seeds)


# --------------------------------------------------------------------------- #
# block quantization
# --------------------------------------------------------------------------- #
def check_operand_shape(
    shape: torch.Size | tuple[int, ...], fmt: str | Format, operand: Operand | str, *, hadamard: bool = False
) -> None:
    """Raise ValueError unless a (rows, cols) operand (reduction dim last) fits ``fmt``'s blocks."""
    spec = get_format(fmt) if isinstance(fmt, str) else fmt
    operand = Operand(operand)
    if len(shape) != 2:
        raise ValueError(
            f"quantize expects a 2-D (rows, cols) operand with the GEMM's reduction dim last; got shape {tuple(shape)}"
        )
    rows, cols = shape
    if rows * cols > 2**32:
        raise ValueError(f"quantize: operand {rows}x{cols} has more than 2**32 elements; split it")
    if hadamard and cols % RHT_SIZE:
        raise ValueError(
            f"the {RHT_SIZE}-point Hadamard transform runs along the reduction (last) dim, which has size {cols}; "
            f"it must be a multiple of {RHT_SIZE}"
        )
    if not spec.quantizes:
        return
    br, bc = spec.block_for(operand)
    if bc and cols % bc:
        raise ValueError(
            f"format {spec.name!r} quantizes {operand.value} operands in blocks of {bc} along the reduction "
            f"(last) dim, which has size {cols}; make that dim a multiple of {bc} (for a sharded linear: "
            f"the local size after tensor parallelism) or pick another format for this GEMM"
        )
    if br > 1 and rows % br:
        raise ValueError(
            f"format {spec.name!r} quantizes {operand.value} operands in {br}x{bc} blocks, but the "
            f"non-reduction (first) dim has size {rows}; make it a multiple of {br} or pick another format"
        )


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor (NaN if x has a NaN) - the local amax to reduce over TP."""
    return x.detach().abs().amax().to(torch.float32)


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
    if hadamard:
        p = _rht_physical(p, colwise)
    if not spec.quantizes:
        return p
    elem = spec.element_for(operand)
    assert elem is not None
    rows, cols = (p.shape[1], p.shape[0]) if colwise else (p.shape[0], p.shape[1])
    noise = None if seeds is None else _noise_physical(rows, cols, colwise, seeds)

    if spec.scaling is Scaling.TENSOR:
        a = p.abs().amax() if amax is None else amax
        scale = _rdiv(elem.max, a).clamp(max=_F32_MAX)  # a tiny -> Inf -> the largest float
        scale = torch.where(a == 0, torch.ones_like(scale), scale)
        scale_inv = torch.where(torch.isfinite(a), 1.0 / scale, torch.full_like(scale, float("nan")))
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
        # scale = 2**floor(log2(max / amax)) (TE Float8BlockScaling with power-of-2
        # scales): the block max never saturates.
        k = _floor_log2(_rdiv(elem.max, block_amax)).clamp(-127, 127)
        k = torch.where(block_amax == 0, torch.zeros_like(k), k)
        scale_inv = torch.where(finite, _exp2i(-k), torch.full_like(block_amax, nan))
        y = round_to_element(pb * _exp2i(k), elem, nb).mul_(scale_inv)

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
        # one pass over the operand fewer than p.abs().amax().
        a = block_amax.amax() if amax is None else amax
        s_enc = _rdiv(_NVFP4_TENSOR_MAX, a).clamp(max=_F32_MAX)
        s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
        s_dec = 1.0 / s_enc
        s_block = round_e4m3((block_amax * (s_enc * _RCP_E2M1_MAX)).clamp(max=_F32_MAX))
        enc = (1.0 / (s_block * s_dec)).clamp(max=_F32_MAX)  # zero block -> largest float; x = 0 stays 0
        s_block = torch.where(finite & torch.isfinite(a), s_block, torch.full_like(s_block, nan))
        # clamp before rounding: a block whose E4M3 scale underflowed to 0 must give 0, not Inf * 0
        q = round_to_element((pb * enc).clamp_(-elem.max, elem.max), elem, nb)
        y = q.mul_(s_block).mul_(s_dec)  # q * s_block is exact; one rounding by the tensor scale

    else:  # pragma: no cover - every Scaling is handled above
        raise AssertionError(spec.scaling)
    return y.reshape(p.shape)


# --------------------------------------------------------------------------- #
# compiled variants
# --------------------------------------------------------------------------- #
_QdqFn = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]
_CompileKey = tuple  # (format, operand, hadamard, colwise, physical shape, device type, has amax, has seeds)
_COMPILED: dict[_CompileKey, _QdqFn] = {}
_COMPILE_ERROR: list[str] = []  # the first failure; after it everything runs eager


def _qdq_template(p: torch.Tensor, amax: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor:
    return _qdq(p, _SPEC, _OPERAND, _HADAMARD, _COLWISE, amax, seeds)  # type: ignore[name-defined]  # noqa: F821


def _specialized(spec: Format, operand: Operand, hadamard: bool, colwise: bool, tag: str = "") -> _QdqFn:
    """A copy of ``_qdq_template`` with its own code object and its constants bound as globals.

    torch.compile keeps compiled graphs, guards and its recompile budget (8) per code
    object. One code object per compile key (``tag`` names the shape) means each holds
    exactly one graph: no variant evicts another or silently falls back to eager after
    8 shapes, and a call checks one set of guards instead of trying several.
    """
    name = f"qdq_{spec.name}_{operand.value}{'_rht' if hadamard else ''}{'_colwise' if colwise else ''}{tag}"
    code = _qdq_template.__code__.replace(co_name=name)
    glb = dict(globals(), _SPEC=spec, _OPERAND=operand, _HADAMARD=hadamard, _COLWISE=colwise)
    return types.FunctionType(code, glb, name)


def _get_compiled(
    spec: Format, operand: Operand, hadamard: bool, colwise: bool, p: torch.Tensor, amax: object, seeds: object
) -> _QdqFn:
    # Static shapes: a training run sees a handful of fixed operand shapes, and static
    # kernels measured several times faster than dynamic=True ones here (symbolic block
    # reshapes and noise counters defeat vectorization: 0.06 vs 0.5 Gelem/s for nvfp4
    # gradients). The Format itself (frozen, compared by value) is in the key: a modified
    # spec under the same name gets its own kernel.
    key = (spec, operand, hadamard, colwise, tuple(p.shape), p.device.type, amax is None, seeds is None)
    fn = _COMPILED.get(key)
    if fn is None:
        tag = f"_{p.shape[0]}x{p.shape[1]}{'_amax' if amax is not None else ''}"
        fn = torch.compile(_specialized(spec, operand, hadamard, colwise, tag), dynamic=False)
        _COMPILED[key] = fn
    return fn


def compiled_quantizers_available() -> tuple[bool, str]:
    """(False, reason) once a compilation has failed in this process (everything then runs eager)."""
    return (not _COMPILE_ERROR, _COMPILE_ERROR[0] if _COMPILE_ERROR else "")


def _run_qdq(
    p: torch.Tensor,
    spec: Format,
    operand: Operand,
    hadamard: bool,
    colwise: bool,
    amax: torch.Tensor | None,
    seeds: torch.Tensor | None,
    compiled: bool,
) -> torch.Tensor:
    if compiled and not _COMPILE_ERROR:
        try:
            return _get_compiled(spec, operand, hadamard, colwise, p, amax, seeds)(p, amax, seeds)
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, loudly, once
            first_line = str(e).splitlines()[0] if str(e) else ""
            _COMPILE_ERROR.append(f"{type(e).__name__}: {first_line}")
            warnings.warn(
                f"torch.compile of the quantizers failed ({_COMPILE_ERROR[0]}); running them eagerly "
                "(identical numerics, ~10x slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    return _qdq(p, spec, operand, hadamard, colwise, amax, seeds)


# --------------------------------------------------------------------------- #
# public entry point
# --------------------------------------------------------------------------- #
_IDENTITY = get_format("bf16")


def quantize(
    x: torch.Tensor,
    fmt: str,
    operand: Operand | str,
    *,
    generator: torch.Generator | None = None,
    hadamard: bool = False,
    amax: torch.Tensor | None = None,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Quantize-dequantize one GEMM operand in format ``fmt``.

    Args:
        x: (rows, cols) tensor, any float dtype (computed in fp32), with the
            GEMM's reduction dim LAST. May be a transposed view (processed in
            place of its contiguous base; same result). Not modified.
        fmt: format name (``formats.FORMATS``); ``"bf16"`` is the identity.
        operand: ACTIVATION, WEIGHT or GRADIENT - picks the element type
            (``fp8``: E5M2 for gradients), the block shape (2-D blocks for
            ``fp8_block``/``nvfp4`` weights) and stochastic rounding (``nvfp4``
            gradients).
        generator: source of the stochastic-rounding randomness, used iff the
            format rounds this operand stochastically (None: torch's default
            generator). Exactly one draw of two 32-bit seeds per call; element
            (i, j) then gets ``uniform_noise(rows, cols, seeds)[i, j]``.
        hadamard: rotate first: returns Q(x · H) with H the block-diagonal
            16-point random Hadamard transform along the last dim (amaxes and
            scales are those of the rotated tensor). Both wgrad operands get
            it, so their product approximates the unrotated one.
        amax: whole-tensor amax (of the rotated tensor when ``hadamard``)
            already reduced over the tensor-parallel group, so that shards
            agree with the unsharded tensor. Used by formats with a tensor scale
            (``fp8``, ``nvfp4``), ignored by the others. Default: local amax.
        amax_reduce: alternative to ``amax``: a callable applied to the local
            0-d tensor amax (e.g. an all-reduce MAX over the TP group); called
            exactly once for formats with a tensor scale, never otherwise.
        compiled: run through ``torch.compile`` (same numerics, 10-30x faster
            after a one-off compile per format/operand kind/layout/shape).

    Returns:
        fp32 tensor of x's shape (in x's layout, so possibly a transposed
        view): the dequantized - and, with ``hadamard``, rotated - operand.

    Raises:
        ValueError: unknown format; x not 2-D; a dim not a multiple of the
            format's block (``check_operand_shape``); both amax and amax_reduce.
    """
    spec = get_format(fmt)
    operand = Operand(operand)
    check_operand_shape(x.shape, spec, operand, hadamard=hadamard)
    if amax is not None and amax_reduce is not None:
        raise ValueError("quantize: pass either amax (already reduced) or amax_reduce (to reduce the local amax), not both")
    x32 = x.to(torch.float32)  # keeps a transposed layout
    colwise = not x32.is_contiguous() and x32.t().is_contiguous()
    p = x32.t() if colwise else x32.contiguous()

    seeds = draw_seeds(generator, p.device) if spec.stochastic_for(operand) else None
    if amax is not None:
        amax = amax.detach().to(device=p.device, dtype=torch.float32).reshape(())
    if spec.uses_tensor_amax and amax_reduce is not None:
        # The collective sits between the local amax and the scales, so rotate first.
        if hadamard:
            p = _run_qdq(p, _IDENTITY, operand, True, colwise, None, None, compiled)
            hadamard = False
        amax = amax_reduce(tensor_amax(p)).to(torch.float32).reshape(())
    y = _run_qdq(p, spec, operand, hadamard, colwise, amax, seeds, compiled)
    return y.t() if colwise else y
