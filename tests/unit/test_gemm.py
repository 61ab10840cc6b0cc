"""quant_linear: each GEMM equals a hand-written quantize-then-matmul reference bit for bit.

The references below spell out the contract of gemm.py's docstring:
    fprop  Y  = Q(X) · Q(W)ᵀ         dgrad  dX = Q(dY) · Q(Wᵀ)ᵀ
    wgrad  dW = Q(dYᵀ) · Q(Xᵀ)ᵀ      (nvfp4: both wgrad operands rotated by the RHT)
with stochastic-rounding draws in the order dgrad's dY, then wgrad's dYᵀ.
fp32 throughout; CPU; a few seconds.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_snip.precision.formats import FORMATS, Operand, get_format
from megatron_snip.precision.gemm import AmaxReducers, quant_linear
from megatron_snip.precision.gemm_shapes import gemm_shape_error
from megatron_snip.precision.plan import GEMMS, GemmPrecision
from megatron_snip.precision.quantize import quantize

LOW_PRECISION = [f for f in FORMATS if f != "bf16"] + ["nvfp4-sr-rht", "mxfp4+sr+rht"]  # + recipe variants
T_SHAPE, K, N = (4, 32), 128, 256  # x (4, 32, 128): T = 128 tokens


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na].contiguous().view(torch.int32), b[~nb].contiguous().view(torch.int32))


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*T_SHAPE, K, generator=g)
    w = torch.randn(N, K, generator=g) * K**-0.5
    dy = torch.randn(*T_SHAPE, N, generator=g)
    return x, w, dy


def run(x, w, dy, precision, seed=11, **kw):
    """Forward + backward through quant_linear; returns (y, dx, dw)."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = quant_linear(x, w, precision, generator=torch.Generator().manual_seed(seed), **kw)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def reference(x, w, dy, precision, seed=11, amax_reduce=None):
    """Hand-written quantize-then-matmul for each GEMM (the same draw order as gemm.py); every
    operand of every GEMM reduces its own amax with ``amax_reduce`` (an AmaxReducers or one callable)."""
    g = torch.Generator().manual_seed(seed)
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    red = AmaxReducers.of(amax_reduce)

    def q(t, fmt, kind, reduce, h=False):
        return quantize(t, fmt, kind, generator=g, hadamard=h, amax_reduce=reduce)

    f, d, wg = precision.fprop, precision.dgrad, precision.wgrad
    y = x2 @ w.t() if f == "bf16" else q(x2, f, Operand.ACTIVATION, red.x) @ q(w, f, Operand.WEIGHT, red.w).t()
    dx = dy2 @ w if d == "bf16" else q(dy2, d, Operand.GRADIENT, red.dy) @ q(w.t(), d, Operand.WEIGHT, red.w).t()
    if wg == "bf16":
        dw = dy2.t() @ x2
    else:
        h = get_format(wg).wgrad_hadamard
        dw = q(dy2.t(), wg, Operand.GRADIENT, red.dy, h) @ q(x2.t(), wg, Operand.ACTIVATION, red.x, h).t()
    return y.reshape(*T_SHAPE, N), dx.reshape(x.shape), dw


def test_all_bf16_matches_f_linear():
    x, w, dy = make_inputs()
    y, dx, dw = run(x, w, dy, GemmPrecision())
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    yr = F.linear(xr, wr)
    yr.backward(dy)
    torch.testing.assert_close(y, yr.detach(), rtol=0, atol=0)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, wr.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", LOW_PRECISION)
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_each_gemm_matches_reference_bitwise(fmt, gemm):
    x, w, dy = make_inputs()
    precision = GemmPrecision(**{gemm: fmt})  # this GEMM quantized, the others bf16
    got = run(x, w, dy, precision)
    want = reference(x, w, dy, precision)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert bits_equal(a, b), (fmt, gemm, name)
    # and the quantized GEMM really differs from the unquantized one
    idx = ["fprop", "dgrad", "wgrad"].index(gemm)
    assert not torch.equal(got[idx], run(x, w, dy, GemmPrecision())[idx])


def test_mixed_precisions_and_all_nvfp4():
    x, w, dy = make_inputs(1)
    for precision in (GemmPrecision("nvfp4", "fp8", "mxfp8"), GemmPrecision("mxfp4", "nvfp4", "fp8_block"),
                      GemmPrecision.uniform("nvfp4")):
        got, want = run(x, w, dy, precision), reference(x, w, dy, precision)
        assert all(bits_equal(a, b) for a, b in zip(got, want)), precision


def test_stochastic_rounding_depends_on_generator_only():
    x, w, dy = make_inputs(2)
    p = GemmPrecision.uniform("nvfp4")
    a, b, c = run(x, w, dy, p, seed=1), run(x, w, dy, p, seed=1), run(x, w, dy, p, seed=2)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(a[0], c[0])  # fprop has no stochastic rounding
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[2], c[2])


def test_leading_dims_are_tokens():
    x, w, dy = make_inputs(3)
    p = GemmPrecision("nvfp4", "mxfp8", "nvfp4")
    y3, dx3, dw3 = run(x, w, dy, p)
    y2, dx2, dw2 = run(x.reshape(-1, K), w, dy.reshape(-1, N), p)
    assert y3.shape == (*T_SHAPE, N) and dx3.shape == x.shape
    assert bits_equal(y3.reshape(-1, N), y2) and bits_equal(dx3.reshape(-1, K), dx2) and bits_equal(dw3, dw2)


def test_amax_reduce_is_called_and_used():
    x, w, dy = make_inputs(4)
    calls = []

    def fake_all_reduce_max(local: torch.Tensor) -> torch.Tensor:
        calls.append(local.clone())
        return local * 3  # as if another TP shard held a 3x larger amax (not a power of 2: that would only shift exponents)

    # Six operands quantized; one reduction per tensor: X, W, dY (fp8: 3), plus nvfp4's rotated
    # wgrad operands dYᵀH and XᵀH (5). The reference reduces all six: the same bits.
    for fmt, n_calls in (("fp8", 3), ("nvfp4", 5), ("mxfp8", 0)):
        calls.clear()
        p = GemmPrecision.uniform(fmt)
        got = run(x, w, dy, p, amax_reduce=fake_all_reduce_max)
        assert len(calls) == n_calls, fmt
        want = reference(x, w, dy, p, amax_reduce=lambda a: a * 3)
        assert all(bits_equal(a, b) for a, b in zip(got, want)), fmt
        if n_calls:
            assert not torch.equal(got[0], run(x, w, dy, p)[0])  # the reduced amax changed the scales


@pytest.mark.parametrize("operand", ["x", "w", "dy"])
def test_amax_reducers_per_operand(operand):
    """Only the operand given a reducer reduces (in every GEMM that quantizes it); the others use
    their local amax - a replicated operand's local amax is the whole tensor's."""
    x, w, dy = make_inputs(7)
    calls = []

    def reduce(local):
        calls.append(1)
        return local * 3

    red = AmaxReducers(**{operand: reduce})
    for p in (GemmPrecision.uniform("fp8"), GemmPrecision("mxfp8", "fp8", "nvfp4")):
        calls.clear()
        got = run(x, w, dy, p, amax_reduce=red)
        # fp8 everywhere: once per tensor. Mixed: W only in dgrad (1); dY in dgrad and, rotated, in
        # wgrad (2); X only rotated in wgrad (1).
        assert len(calls) == (2 if operand == "dy" and p.wgrad == "nvfp4" else 1), (operand, p)
        want = reference(x, w, dy, p, amax_reduce=red)
        assert all(bits_equal(a, b) for a, b in zip(got, want)), (operand, p)
        assert not all(bits_equal(a, b) for a, b in zip(got, run(x, w, dy, p))), (operand, p)  # the reducer mattered


def test_nan_input_propagates():
    x, w, dy = make_inputs(5)
    x[1, 3, 7] = float("nan")
    for fmt in LOW_PRECISION:
        y, _, dw = run(x, w, dy, GemmPrecision.uniform(fmt))
        assert torch.isnan(y[1, 3]).all(), fmt  # the poisoned token's outputs
        assert torch.isnan(dw).any(), fmt  # wgrad reads X
        if not get_format(fmt).uses_tensor_amax:  # (a NaN tensor amax poisons the whole tensor)
            assert torch.isfinite(y[0]).all(), fmt  # other tokens' blocks are clean


def test_bf16_activations_keep_their_dtype():
    x, w, dy = make_inputs(6)
    xb, dyb = x.to(torch.bfloat16), dy.to(torch.bfloat16)
    for p in (GemmPrecision(), GemmPrecision.uniform("nvfp4"), GemmPrecision("nvfp4", "bf16", "fp8")):
        y, dx, dw = run(xb, w, dyb, p)
        assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    # quantized GEMMs accumulate in fp32 on fp32 operands, then cast once
    y = run(xb, w, dyb, GemmPrecision("mxfp8"))[0]
    want = (quantize(xb.reshape(-1, K), "mxfp8", "activation") @ quantize(w, "mxfp8", "weight").t()).to(torch.bfloat16)
    assert torch.equal(y.reshape(-1, N), want)


def test_gemm_shape_rules():
    """The block rules live in precision/gemm_shapes.py and are checked once, when a plan is
    applied; quant_linear itself only checks that x and the weight fit together."""

    def errors(precision: GemmPrecision, n: int, k: int, tokens: int) -> str:
        return "; ".join(f"{g} {e}" for g in GEMMS if (e := gemm_shape_error(precision[g], g, n, k, tokens)))

    assert re.search(r"fprop X.*'nvfp4'.*blocks of 16.*size 24", errors(GemmPrecision("nvfp4"), 64, 24, 8))
    assert re.search(r"wgrad.*size 8", errors(GemmPrecision(wgrad="nvfp4"), 64, 32, 8))  # T = 8 is not a multiple of 16
    with pytest.raises(ValueError, match="do not fit"):
        quant_linear(torch.randn(8, 32), torch.randn(64, 16), GemmPrecision())
    assert errors(GemmPrecision.uniform("fp8_block"), 256, 128, 128) == ""
    assert re.search(r"dgrad .*W\^T \(128, 200\)", errors(GemmPrecision(dgrad="fp8_block"), 200, 128, 128))
    with pytest.raises(ValueError, match="gemm='fc1'"):
        gemm_shape_error("fp8", "fc1", 64, 64, 64)
    # Called directly with a misfit, the first quantizer that meets it still refuses.
    with pytest.raises(ValueError, match=r"'nvfp4'.*blocks of 16.*size 24"):
        quant_linear(torch.randn(8, 24), torch.randn(64, 24), GemmPrecision("nvfp4"))


class QuantLinear(nn.Module):
    """A bias-free linear layer holding its weight and a ``GemmPrecision`` (test helper).

    ``set_precision`` swaps the formats between calls without rebuilding, as
    ``PrecisionLinear`` does under ``apply_plan``.
    """

    def __init__(self, in_features: int, out_features: int, *, precision: GemmPrecision | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default
        self.precision = precision or GemmPrecision()

    def set_precision(self, precision: GemmPrecision) -> None:
        if not isinstance(precision, GemmPrecision):
            raise TypeError(f"QuantLinear.set_precision: expected a GemmPrecision, got {type(precision).__name__}")
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.weight, self.precision)

    def extra_repr(self) -> str:
        p = self.precision
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"precision=({p.fprop}, {p.dgrad}, {p.wgrad})")


def test_quant_linear_module_set_precision():
    torch.manual_seed(0)
    layer = QuantLinear(K, N)
    x, _, dy = make_inputs(7)
    y_bf16 = layer(x)
    layer.set_precision(GemmPrecision.uniform("nvfp4"))
    y = layer(x)
    y.backward(dy)
    assert layer.weight.grad is not None and layer.weight.grad.shape == (N, K)
    assert not torch.equal(y, y_bf16) and ((y - y_bf16).norm() / y_bf16.norm()) < 0.2
    assert "nvfp4" in repr(layer)
    with pytest.raises(TypeError, match="GemmPrecision"):
        layer.set_precision("nvfp4")  # type: ignore[arg-type]


def test_frozen_weight_and_no_input_grad():
    x, w, dy = make_inputs(8)
    p = GemmPrecision.uniform("mxfp4")
    xg = x.clone().requires_grad_(True)
    quant_linear(xg, w, p).backward(dy)  # weight without grad: wgrad skipped
    assert xg.grad is not None
    wg = w.clone().requires_grad_(True)
    quant_linear(x, wg, p).backward(dy)
    assert wg.grad is not None


@pytest.mark.parametrize("precision", [GemmPrecision.uniform("fp8"), GemmPrecision.uniform("nvfp4"),
                                       GemmPrecision("bf16", "mxfp8", "nvfp4"), GemmPrecision("fp8", "bf16", "bf16")])
def test_autocast_leaves_quantized_gemms_in_fp32(precision):
    # The autograd function decides the accumulation precision: under bf16 autocast a quantized
    # GEMM still multiplies and accumulates in fp32 (only Y is cast to bf16), in forward and in
    # backward, while a "bf16" GEMM runs in bf16 exactly as F.linear does under that autocast.
    x, w, dy = make_inputs(3)
    plain = run(x, w, dy, precision)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = run(x, w, dy.bfloat16(), precision)
    assert cast[0].dtype == torch.bfloat16
    if precision.fprop == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(cast[0], F.linear(x, w))
    else:
        assert torch.equal(cast[0], plain[0].bfloat16())
    assert cast[1].dtype == x.dtype and cast[2].dtype == w.dtype
    # backward under no autocast with the same (bf16-valued) incoming gradient
    same_dy = run(x, w, dy.bfloat16().float(), precision)
    for i, gemm in ((1, "dgrad"), (2, "wgrad")):
        if precision[gemm] == "bf16":
            bf = {"dgrad": dy.bfloat16() @ w.bfloat16(),
                  "wgrad": dy.bfloat16().reshape(-1, N).t() @ x.bfloat16().reshape(-1, K)}[gemm]
            assert torch.equal(cast[i], bf.to(torch.float32).reshape(cast[i].shape)), gemm
        else:
            assert bits_equal(cast[i], same_dy[i]), gemm
