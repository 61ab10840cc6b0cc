"""Element rounding: fp32 values onto the E4M3, E5M2, E2M1 grids (RNE or stochastic) and E8M0.

Rounders saturate: finite values beyond the max and +-Inf round to +-max; NaN
stays NaN; -0.0 stays -0.0. Checked exhaustively against ``ml_dtypes``.
"""

from __future__ import annotations

import torch

from megatron_snip.precision.formats import E2M1, E4M3, E5M2, Element
from megatron_snip.precision.quantize.bits import _exp2i, _floor_log2

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
