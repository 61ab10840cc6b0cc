"""Reference quantizers: element rounding vs ml_dtypes, block scaling edge cases,
stochastic rounding, the Hadamard transform, layouts, compiled == eager.

All checks run on CPU in fp32; the whole file takes a few seconds plus one
torch.compile warm-up (test_compiled_matches_eager).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_snip.precision.formats import (
    E2M1,
    E4M3,
    E5M2,
    FORMATS,
    Operand,
    get_format,
)
from megatron_snip.precision.quantize import compiled, noise, quantize, rounding
from megatron_snip.precision.quantize.hadamard import hadamard_transform, rht_matrix
from megatron_snip.precision.quantize.noise import uniform_noise
from megatron_snip.precision.quantize.rounding import round_e2m1, round_e4m3, round_e5m2, round_e8m0

LOW_PRECISION = [f for f in FORMATS if f != "bf16"]
NAN = float("nan")
INF = float("inf")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, with any NaN equal to any NaN (payloads may differ)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    return torch.equal(a[~na].contiguous().view(torch.int32), b[~nb].contiguous().view(torch.int32))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- #
# element rounding vs ml_dtypes
# --------------------------------------------------------------------------- #
ROUNDERS = [(round_e4m3, ml_dtypes.float8_e4m3fn, E4M3), (round_e5m2, ml_dtypes.float8_e5m2, E5M2),
            (round_e2m1, ml_dtypes.float4_e2m1fn, E2M1)]


def _grid_and_midpoints(ml_type) -> np.ndarray:
    """Every finite value of ml_type, every midpoint between neighbours and the floats next to each midpoint."""
    n_bits = 4 if ml_type == ml_dtypes.float4_e2m1fn else 8
    vals = np.arange(2**n_bits, dtype=np.uint8).view(ml_type).astype(np.float32)  # every code
    pos = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (pos[:-1].astype(np.float64) + pos[1:]) / 2)  # exact in fp32
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    x = np.concatenate([pos, mids, near])
    return np.concatenate([x, -x]).astype(np.float32)


@pytest.mark.parametrize("rounder,ml_type,elem", ROUNDERS, ids=["e4m3", "e5m2", "e2m1"])
def test_element_rounding_matches_ml_dtypes(rounder, ml_type, elem):
    x = _grid_and_midpoints(ml_type)
    x = x[np.abs(x) <= elem.max]  # ml_dtypes overflows past max; saturation is tested separately
    want = x.astype(ml_type).astype(np.float32)
    got = rounder(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))  # incl. the sign of zero


@pytest.mark.parametrize("rounder,ml_type,elem", ROUNDERS, ids=["e4m3", "e5m2", "e2m1"])
def test_element_rounding_random_values_match_ml_dtypes(rounder, ml_type, elem):
    g = torch.Generator().manual_seed(1)
    # log-uniform magnitudes from far below the subnormals up to the max
    mag = torch.exp2(torch.empty(20000).uniform_(math.log2(elem.max) - 40, math.log2(elem.max), generator=g))
    x = (mag * torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0)).numpy()
    want = x.astype(ml_type).astype(np.float32)
    np.testing.assert_array_equal(rounder(torch.from_numpy(x)).numpy(), want)


@pytest.mark.parametrize("rounder,elem", [(round_e4m3, E4M3), (round_e5m2, E5M2), (round_e2m1, E2M1)])
def test_element_rounding_saturates_and_keeps_nan(rounder, elem):
    x = torch.tensor([elem.max * 1.01, elem.max * 3, 1e30, INF, -INF, -1e30, NAN, -0.0])
    y = rounder(x)
    m = elem.max
    assert y[:6].tolist() == [m, m, m, m, -m, -m]
    assert math.isnan(y[6].item())
    assert y[7].item() == 0 and math.copysign(1, y[7].item()) == -1


@pytest.mark.parametrize("rounder,ml_type,elem", ROUNDERS, ids=["e4m3", "e5m2", "e2m1"])
def test_arithmetic_rounding_matches_ml_dtypes_and_eager_fast_paths(rounder, ml_type, elem):
    # round_eXmY above runs the eager fast paths (float8 casts, the E2M1 magic add); torch.compile
    # traces rounding._round_arith instead. Pin the latter to ml_dtypes too, and both to each other on
    # the values ml_dtypes cannot judge (saturation, Inf, NaN, signed zeros, fp32 subnormals).
    x = _grid_and_midpoints(ml_type)
    x = x[np.abs(x) <= elem.max]
    want = x.astype(ml_type).astype(np.float32)
    got = rounding._round_arith(torch.from_numpy(x), elem, None).numpy()
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    g = torch.Generator().manual_seed(2)
    mag = torch.exp2(torch.empty(20000).uniform_(math.log2(elem.max) - 40, math.log2(elem.max) + 3, generator=g))
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-40, elem.max, elem.max * 1.01, 1e30, 3e38, INF, -INF, NAN])
    xs = torch.cat([mag * torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0), special, -special])
    assert bits_equal(rounding._round_arith(xs, elem, None), rounder(xs))


def test_eager_noise_matches_traced_noise():
    # _uniform_from_counter runs the hash in place when eager, functionally (_mix32) when traced.
    counter = torch.randint(-(2**31), 2**31, (5000,), generator=gen(0), dtype=torch.int32)
    seeds = torch.tensor([-123456789, 2**31 - 5], dtype=torch.int32)
    before = counter.clone()
    u = noise._uniform_from_counter(counter, seeds)
    assert torch.equal(counter, before)  # the caller's counters are not modified
    h = noise._mix32(noise._mix32(counter + seeds[0]) ^ seeds[1])
    assert torch.equal(u, ((h >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-24)


def test_e8m0_rounding_matches_ml_dtypes():
    k = np.arange(-127, 128, dtype=np.float64)
    reps = np.exp2(k).astype(np.float32)
    mids = (1.5 * np.exp2(k[:-1])).astype(np.float32)  # ties: both round up
    # Floats next to the midpoints; skip k = -127, where ml_dtypes rounds fp32 subnormal inputs up.
    near = np.concatenate([np.nextafter(mids[1:], np.float32(0)), np.nextafter(mids[1:], np.float32(np.inf))])
    x = np.concatenate([reps, mids, near])
    want = x.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(round_e8m0(torch.from_numpy(x)).numpy(), want)


def test_e8m0_out_of_range():
    y = round_e8m0(torch.tensor([0.0, 1e-45, 3e38, INF, -1.0, NAN]))
    assert y[:4].tolist() == [2.0**-127, 2.0**-127, 2.0**127, 2.0**127]  # saturating (ml_dtypes: NaN)
    assert torch.isnan(y[4:]).all()  # no sign, no NaN-free encoding of NaN


# --------------------------------------------------------------------------- #
# stochastic rounding
# --------------------------------------------------------------------------- #
def test_stochastic_rounding_is_unbiased():
    # Values strictly inside E2M1 intervals; 40k independent draws each.
    vals = torch.tensor([0.1, 0.3, 0.8, 1.1, 1.7, 2.2, 2.9, 3.3, 4.6, 5.9])
    n = 40000
    x = vals.repeat(n, 1)
    noise = torch.rand(x.shape, generator=gen(3))
    y = round_e2m1(x, noise)
    mean = y.mean(0)
    # Each draw is lo or hi: std <= (hi - lo) / 2 <= 1 (largest gap 4..6 is 2), so the
    # standard error is <= 1/sqrt(n) = 0.005; allow 5 standard errors.
    assert torch.all((mean - vals).abs() < 5 / math.sqrt(n)), (mean - vals)
    # and it only ever picks the two neighbours
    assert set(y[:, 4].unique().tolist()) == {1.5, 2.0}


def test_nvfp4_gradient_stochastic_rounding_unbiased_and_deterministic():
    # Every row: the same 16-element block whose max (6.0) pins the scales, so each
    # element is SR-rounded on a fixed grid; rows get independent noise.
    row = torch.tensor([6.0, 0.3, -0.8, 1.1, 1.7, -2.2, 2.9, 3.3, 4.6, 5.9, 0.05, -0.6, 1.25, 2.5, -3.7, 0.0])
    x = row.repeat(8192, 1)
    y = quantize(x, "nvfp4", Operand.GRADIENT, generator=gen(7))
    err = (y.mean(0) - row).abs()
    # per-element spacing here is <= 2 * (6.0 / 6) -> std <= 1, 8192 rows: 5 sigma = 0.055
    assert torch.all(err < 5 / math.sqrt(8192)), err
    assert bits_equal(y, quantize(x, "nvfp4", Operand.GRADIENT, generator=gen(7)))  # fixed seed -> same draws
    assert not torch.equal(y, quantize(x, "nvfp4", Operand.GRADIENT, generator=gen(8)))
    # activations are never stochastic
    a = quantize(x, "nvfp4", Operand.ACTIVATION, generator=gen(1))
    assert torch.equal(a, quantize(x, "nvfp4", Operand.ACTIVATION, generator=gen(2)))


def _mix32_python(h: int) -> int:
    """The noise mixer in plain Python integers (the specification of noise._mix32)."""
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x21F0AAAD) & m
    h ^= h >> 15
    h = (h * 0x735A2D97) & m
    return h ^ (h >> 15)


def test_uniform_noise_golden_values():
    # Pins the counter-based generator to exact integer arithmetic mod 2**32: a
    # backend whose int32 multiply did not wrap, or a changed hash, fails here.
    seeds = torch.tensor([-123456789, 2**31 - 5], dtype=torch.int32)
    s0, s1 = (int(v) & 0xFFFFFFFF for v in seeds)

    def want(counter: int) -> float:
        h = _mix32_python(_mix32_python((counter + s0) & 0xFFFFFFFF) ^ s1)
        return (h >> 8) * 2.0**-24

    rows, cols = 300, 500
    u = uniform_noise(rows, cols, seeds)
    for i, j in [(0, 0), (0, 1), (1, 0), (123, 456), (rows - 1, cols - 1)]:
        assert u[i, j].item() == want(i * cols + j), (i, j)
    # counters past 2**31 (tensors over 2G elements) wrap like uint32
    big = [2**31 - 1, 2**31, 2**32 - 1]
    counters = torch.tensor([c - 2**32 if c >= 2**31 else c for c in big], dtype=torch.int32)
    got = noise._uniform_from_counter(counters, seeds)
    assert got.tolist() == [want(c) for c in big]


def test_uniform_noise_statistics():
    u = uniform_noise(512, 512, torch.tensor([12345, 678]))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.003  # 262k draws: se 0.00056
    assert abs(u.var().item() - 1 / 12) < 0.002
    # neighbours (same row, next row) uncorrelated
    c_row = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    c_col = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    assert abs(c_row) < 0.01 and abs(c_col) < 0.01
    # different seeds -> different, uncorrelated draws
    v = uniform_noise(512, 512, torch.tensor([12346, 678]))
    assert abs(torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1]) < 0.01


# --------------------------------------------------------------------------- #
# Hadamard transform
# --------------------------------------------------------------------------- #
def test_rht_matrix_orthogonal_with_te_signs():
    h = rht_matrix(torch.float64)
    torch.testing.assert_close(h @ h.t(), torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))


def test_hadamard_transform_matches_matrix_and_inverts():
    x = torch.randn(64, 256, generator=gen(0))
    hx = hadamard_transform(x)
    torch.testing.assert_close(hx, (x.reshape(-1, 16) @ rht_matrix()).reshape(x.shape), rtol=0, atol=1e-6)
    torch.testing.assert_close(hadamard_transform(hx, inverse=True), x, rtol=0, atol=1e-6)
    torch.testing.assert_close(hx.norm(dim=1), x.norm(dim=1), rtol=1e-6, atol=0)  # orthogonal
    # rotating both GEMM operands along the reduction dim leaves the product unchanged
    w = torch.randn(32, 256, generator=gen(1))
    torch.testing.assert_close(hx @ hadamard_transform(w).t(), x @ w.t(), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of the 16"):
        hadamard_transform(torch.randn(4, 24))


# --------------------------------------------------------------------------- #
# block scaling
# --------------------------------------------------------------------------- #
def test_bf16_is_identity():
    x = torch.randn(8, 32, generator=gen(0))
    assert torch.equal(quantize(x, "bf16", Operand.ACTIVATION), x)
    assert quantize(x.to(torch.bfloat16), "bf16", Operand.WEIGHT).dtype == torch.float32


@pytest.mark.parametrize("fmt", LOW_PRECISION)
@pytest.mark.parametrize("operand", list(Operand))
def test_all_zero_and_blocks_are_independent(fmt, operand):
    x = torch.randn(256, 256, generator=gen(1))
    x[:128, :128] = 0  # whole blocks of every format (tensor scale: the rest is nonzero)
    y = quantize(x, fmt, operand, generator=gen(2))
    assert torch.all(y[:128, :128] == 0)
    assert torch.isfinite(y).all()
    rel = (y - x).norm() / x.norm()
    assert rel < (0.2 if get_format(fmt).is_fp4 else 0.06), rel


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "nvfp4", "mxfp4", "fp4_block"])
def test_nan_and_inf_poison_only_their_block(fmt):
    spec = get_format(fmt)
    for operand in (Operand.ACTIVATION, Operand.WEIGHT):
        br, bc = spec.block_for(operand)
        x = torch.randn(2 * max(br, 1) * 2, 2 * bc, generator=gen(0))
        for bad in (NAN, INF, -INF):
            xb = x.clone()
            xb[0, 0] = bad
            y = quantize(xb, fmt, operand, amax=torch.tensor(10.0) if spec.uses_tensor_amax else None)
            block = y[:br, :bc]
            assert torch.isnan(block).all(), (fmt, operand, bad)  # never silently finite
            assert torch.isfinite(y[br:, :]).all() and torch.isfinite(y[:, bc:]).all()


def test_nvfp4_local_amax_nonfinite_poisons_tensor_fp8_too():
    x = torch.randn(32, 64, generator=gen(0))
    x[3, 5] = INF
    assert torch.isnan(quantize(x, "nvfp4", Operand.ACTIVATION)).all()  # tensor amax Inf -> no valid scale
    for operand in Operand:
        assert torch.isnan(quantize(x, "fp8", operand)).all()
    x[3, 5] = NAN
    assert torch.isnan(quantize(x, "fp8", Operand.GRADIENT)).all()


@pytest.mark.parametrize("fmt", LOW_PRECISION)
def test_single_outlier_is_kept(fmt):
    # one outlier 1e4 x the rest of its block: it is represented to element precision
    # (the block scale follows it), and the other blocks are untouched by it.
    x = torch.randn(128, 256, generator=gen(5)) * 1e-2
    x[0, 3] = 100.0
    clean = x.clone()
    clean[0, 3] = 0
    y = quantize(x, fmt, Operand.ACTIVATION)
    assert abs(y[0, 3].item() - 100.0) <= 100.0 * 2**-3  # within an E4M3/E2M1 half-spacing of itself
    if get_format(fmt).scaling.value != "tensor" and fmt != "nvfp4":
        yc = quantize(clean, fmt, Operand.ACTIVATION)
        assert torch.equal(y[1:], yc[1:])  # other rows' blocks do not see the outlier


@pytest.mark.parametrize("fmt", LOW_PRECISION)
def test_values_beyond_element_max_and_subnormals(fmt):
    big = torch.randn(32, 128, generator=gen(0)) * 1e30  # far beyond every element max
    yb = quantize(big, fmt, Operand.GRADIENT, generator=gen(1))
    assert torch.isfinite(yb).all()
    assert ((yb / 1e30 - big / 1e30).norm() / (big / 1e30).norm()) < 0.2  # (norms of 1e30s overflow)
    tiny = torch.randn(32, 128, generator=gen(0)) * 1e-39  # fp32 subnormals
    yt = quantize(tiny, fmt, Operand.ACTIVATION)
    assert torch.isfinite(yt).all() and (yt.abs() <= tiny.abs().max() * 1.01).all()
    # The deepest subnormals (±1..3 ulps of 0), where amax / element max underflows fp32: still
    # finite, never larger than the input (fp4_block once divided by its zero scale: NaN).
    deepest = torch.randint(-3, 4, (128, 128), generator=gen(2)).float() * 2.0**-149  # fits every block
    for operand in Operand:
        yd = quantize(deepest, fmt, operand, generator=gen(3))
        assert torch.isfinite(yd).all() and (yd.abs() <= deepest.abs().max()).all(), (fmt, operand)


def test_pow2_block_scale_never_saturates_and_mx_rounding_rules():
    # mxfp8 (scale exponent rounded up): a block max just above 448 * 2**k maps to <= 448
    x = torch.zeros(1, 32)
    x[0, 0] = 449.0
    x[0, 1] = 1.0
    y = quantize(x, "mxfp8", Operand.ACTIVATION)
    assert y[0, 0].item() == 448.0  # scale 2: 224.5 -> 224 (E4M3), * 2 = 448, not clamped from 449
    assert quantize(torch.full((1, 32), 448.0), "mxfp8", Operand.ACTIVATION)[0, 0].item() == 448.0  # scale 1
    # mxfp4 follows OCP MX v1.0: scale 2**(floor(log2 amax) - 2), so amax 7.5 -> scale 1 -> saturates to 6
    x4 = torch.zeros(1, 32)
    x4[0, 0], x4[0, 1] = 7.5, 0.74
    y4 = quantize(x4, "mxfp4", Operand.ACTIVATION)
    assert y4[0, 0].item() == 6.0 and y4[0, 1].item() == 0.5
    # fp8_block: scale 2**floor(log2(448 / amax)): amax 300 -> scale 1, 300 is exact in E4M3? (288/320) -> 288
    xb = torch.zeros(1, 128)
    xb[0, 0] = 300.0
    assert quantize(xb, "fp8_block", Operand.ACTIVATION)[0, 0].item() == 288.0


def test_nvfp4_tensor_and_block_scales():
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    amax = x.abs().max()
    y = quantize(x, "nvfp4", Operand.ACTIVATION)
    # hand computation, TE NVFP4 reference formulas
    s_enc = 448.0 * 6.0 / amax
    s_dec = 1.0 / s_enc
    xb = x.reshape(16, 4, 16)
    s_blk = round_e4m3(xb.abs().amax(-1, keepdim=True) * (s_enc * torch.tensor(1 / 6, dtype=torch.float32)))
    q = round_e2m1((xb * (1.0 / (s_blk * s_dec))).clamp(-6, 6))
    assert bits_equal(y, ((q * s_blk) * s_dec).reshape(16, 64))
    # the tensor amax maps to 6 * 448: its block's E4M3 scale is the E4M3 max
    torch.testing.assert_close(y.abs().max(), amax, rtol=1e-6, atol=0)
    # a caller-supplied (TP-reduced) amax changes the tensor scale
    y2 = quantize(x, "nvfp4", Operand.ACTIVATION, amax=amax * 3)
    assert not torch.equal(y, y2) and (y2 - x).norm() / x.norm() < 0.2


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_tensor_parallel_shards_agree_with_unsharded(fmt):
    # Shards along the non-reduction dim (column-parallel X rows / W rows) with the
    # reduced amax reproduce the unsharded quantization bit for bit.
    x = torch.randn(64, 128, generator=gen(0))
    whole = quantize(x, fmt, Operand.WEIGHT)
    calls = []

    def reduce_max(local):  # stands in for all_reduce(MAX) over 2 shards
        calls.append(local)
        return x.abs().amax()

    shards = [quantize(s, fmt, Operand.WEIGHT, amax_reduce=reduce_max) for s in x.chunk(2, dim=0)]
    assert bits_equal(torch.cat(shards), whole) and len(calls) == 2
    assert bits_equal(quantize(x[:32], fmt, Operand.WEIGHT, amax=x.abs().amax()), whole[:32])
    with pytest.raises(ValueError, match="either amax"):
        quantize(x, fmt, Operand.WEIGHT, amax=torch.tensor(1.0), amax_reduce=reduce_max)


def test_amax_reduce_not_called_without_tensor_scale():
    x = torch.randn(16, 64)
    called = []
    quantize(x, "mxfp8", Operand.ACTIVATION, amax_reduce=lambda a: called.append(a) or a)
    assert not called


def test_error_order_on_gaussian():
    x = torch.randn(1024, 1024, generator=gen(0))
    err = {f: ((quantize(x, f, Operand.ACTIVATION) - x).norm() / x.norm()).item() for f in FORMATS}
    assert err["bf16"] == 0
    assert max(err["fp8"], err["fp8_block"], err["mxfp8"]) < 0.04
    assert max(err["fp8"], err["fp8_block"], err["mxfp8"]) < err["nvfp4"] < err["mxfp4"] < 0.2


# --------------------------------------------------------------------------- #
# shapes and layouts
# --------------------------------------------------------------------------- #
def test_shape_errors_name_format_dim_and_block():
    with pytest.raises(ValueError, match=r"'nvfp4'.*blocks of 16.*size 24"):
        quantize(torch.randn(16, 24), "nvfp4", Operand.ACTIVATION)
    with pytest.raises(ValueError, match=r"'fp8_block'.*128x128.*size 64"):
        quantize(torch.randn(64, 128), "fp8_block", Operand.WEIGHT)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 16, 32), "mxfp8", Operand.ACTIVATION)
    with pytest.raises(ValueError, match="unknown precision format"):
        quantize(torch.randn(16, 32), "fp6", Operand.ACTIVATION)
    with pytest.raises(ValueError, match="Hadamard"):
        quantize(torch.randn(4, 24), "fp8", Operand.GRADIENT, hadamard=True)
    quantize(torch.randn(3, 24), "fp8", Operand.WEIGHT)  # per-tensor scaling: any shape


@pytest.mark.parametrize("fmt", LOW_PRECISION)
def test_transposed_view_matches_contiguous(fmt):
    x = torch.randn(128, 256, generator=gen(0))
    xt_view = x.t().contiguous().t()  # same values, column-major storage
    for operand in Operand:
        for h in (False, True):
            a = quantize(x, fmt, operand, generator=gen(1), hadamard=h)
            b = quantize(xt_view, fmt, operand, generator=gen(1), hadamard=h)
            assert bits_equal(a, b), (fmt, operand, h)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block", "fp8"])
def test_square_weight_blocks_commute_with_transpose(fmt):
    w = torch.randn(256, 384, generator=gen(0))
    assert bits_equal(quantize(w, fmt, Operand.WEIGHT).t(), quantize(w.t().contiguous(), fmt, Operand.WEIGHT))


def test_compiled_matches_eager():
    ok, reason = compiled.compiled_quantizers_available()
    if not ok:
        pytest.skip(f"torch.compile unavailable here: {reason}")
    x = torch.randn(64, 128, generator=gen(0)) * 3
    x[0, :2] = torch.tensor([NAN, INF])
    x[16:32, :16] = 0
    # These variants cover every code path of _qdq but the pow2/tensor scales: nvfp4 gradients
    # (SR noise, RHT, two-level scales, colwise layout), mxfp8 (E8M0 exponent bits, rowwise) and
    # mxfp4 weights (E2M1 round-to-nearest, colwise): eager runs other rounding code than compiled;
    # fp4_block gradients (SR noise rowwise, FP32 block scales: the compiled draws' own kernel).
    cases = [("nvfp4", Operand.GRADIENT, True, x.t().contiguous().t()), ("mxfp8", Operand.ACTIVATION, False, x),
             ("mxfp4", Operand.WEIGHT, False, x.t().contiguous().t()), ("fp4_block", Operand.GRADIENT, False, x)]
    for fmt, operand, h, inp in cases:
        eager = quantize(inp, fmt, operand, generator=gen(1), hadamard=h)
        comp = quantize(inp, fmt, operand, generator=gen(1), hadamard=h, compiled=True)
        assert compiled.compiled_quantizers_available()[0], compiled.compiled_quantizers_available()[1]
        assert bits_equal(eager, comp), (fmt, operand, h)


def test_torchao_cross_check():
    """Independent implementation check (torchao is a dev-only dependency; skipped without it).

    mxfp4 = torchao's OCP FLOOR scaling and mxfp8 = its RCEIL (round-up) scaling, bit for bit.
    nvfp4: torchao orders the two-level scale arithmetic differently from TE (and
    clamps block scales to >= 2**-6), so on data whose block scales stay normal we
    agree to ~1 ulp of the dequantized values, not bitwise.
    """
    pytest.importorskip("torchao", reason="torchao not installed (dev-only cross-check)")
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            per_tensor_amax_to_scale,
        )
    except ImportError as e:
        pytest.skip(f"torchao mx_formats API not available: {e}")
    g = gen(0)
    x = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)  # rows over ~2**20
    mx4 = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.FLOOR)
    assert bits_equal(quantize(x, "mxfp4", Operand.ACTIVATION), mx4.dequantize(torch.float32))
    mx8 = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    assert bits_equal(quantize(x, "mxfp8", Operand.ACTIVATION), mx8.dequantize(torch.float32))
    xn = torch.randn(256, 256, generator=g)
    nv = NVFP4Tensor.to_nvfp4(xn, per_tensor_scale=per_tensor_amax_to_scale(xn.abs().max()))
    torch.testing.assert_close(quantize(xn, "nvfp4", Operand.ACTIVATION), nv.dequantize(torch.float32), rtol=1e-6, atol=0)
