"""The torch backend's FP8 path is fast by construction - the properties no CPU timing can show:

  * every scaled-mm call writes the activation dtype for fprop and dgrad and fp32 for wgrad, with
    fast accumulation for fp8 fprop only, and its arguments pass torch's own meta registration of
    the op (meta tensors are checked as CUDA ones: layouts, 16-multiples, scale shapes/strides);
  * a 128x128-scaled GEMM with K/128 not a multiple of 4 goes through ``F.scaled_mm`` with padded
    scales (meta-checked), where the signature has it, and falls back with its reason where not;
  * each weight is quantized once per step (not per micro-batch, not again for dgrad), and a
    weight update - by the optimizer between steps or in place inside one - invalidates it;
  * a tensor amax is one pass over its input (no |x| temporary).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_snip.config import ModelConfig
from megatron_snip.model.llama import LlamaModel
from megatron_snip.precision.backends import scaled_mm
from megatron_snip.precision.backends.scaled_mm import (
    ScaledMMGemm,
    TorchBackend,
    accumulation_tolerance,
    fast_accum_for,
)
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.gemm import emulated_gemm
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize.blocks import tensor_amax
from megatron_snip.precision.quantize.scaled import dequantize, quantize_scaled
from megatron_snip.precision.scaled_mm_rules import OPERAND_PAIRS, padded_scale_api, scaled_mm_shape_error
from megatron_snip.precision.weight_copies import WeightCopy

CPU_FP8 = scaled_mm.scaled_mm_support("fp8", "cpu", cpu_reference=True)[0]
needs_cpu_fp8 = pytest.mark.skipif(not CPU_FP8, reason="this torch has no CPU FP8 scaled-mm")


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class _Calls:
    """Records every torch._scaled_mm / F.scaled_mm call, runs it on meta tensors first (torch's meta
    registration raises on arguments a GPU would refuse), then computes it: the real CPU op for
    tensor-wise scales, else the product the contract defines (CPU torch refuses block scales)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[dict] = []
        self._v1, self._v2 = torch._scaled_mm, F.scaled_mm
        monkeypatch.setattr(torch, "_scaled_mm", self.v1)
        monkeypatch.setattr(F, "scaled_mm", self.v2)

    def v1(self, mat1, mat2, scale_a, scale_b, *, out_dtype=None, use_fast_accum=False, **kw):
        assert not kw, kw
        meta = self._v1(*map(_meta, (mat1, mat2, scale_a, scale_b)), out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        self.calls.append({"api": "_scaled_mm", "out_dtype": out_dtype, "fast": use_fast_accum, "k": mat1.shape[1]})
        if scale_a.dim() == 0:
            out = self._v1(mat1, mat2, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        else:
            out = _contract(mat1, mat2, scale_a, scale_b, out_dtype)  # scale_b: (K/128, N) or (K/128, N/128)
        assert out.shape == meta.shape and out.dtype == meta.dtype
        return out

    def v2(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, *, output_dtype=None, use_fast_accum=False,
           **kw):
        assert not kw, kw
        meta = self._v2(_meta(mat_a), _meta(mat_b), _meta(scale_a), recipe_a, _meta(scale_b), recipe_b,
                        output_dtype=output_dtype, use_fast_accum=use_fast_accum)
        self.calls.append({"api": "F.scaled_mm", "out_dtype": output_dtype, "fast": use_fast_accum,
                           "k": mat_a.shape[1], "recipes": (recipe_a, recipe_b), "scale_b": scale_b})
        kb = mat_a.shape[1] // 128
        # 1x128: (rows, K/128); 128x128: (L4, rows/128) whose first K/128 rows are the real scales
        tiles = F.ScalingType.BlockWise1x128
        sa = scale_a if recipe_a == tiles else scale_a[:kb].t()
        sb_t = scale_b.t() if recipe_b == tiles else scale_b[:kb]
        out = _contract(mat_a, mat_b, sa, sb_t, output_dtype)
        assert out.shape == meta.shape and out.dtype == meta.dtype
        return out


def _contract(mat1, mat2, sa, sb_t, out_dtype):
    """mat1 (M, K) · mat2 (K, N) with a's scales sa (M or M/128, K/128) and b's sb_t (K/128, N or N/128)."""
    (m, k), n = mat1.shape, mat2.shape[1]
    rows_a, cols_b, kb = torch.arange(m) // (m // sa.shape[0]), torch.arange(n) // (n // sb_t.shape[1]), \
        torch.arange(k) // 128
    return ((mat1.float() * sa[rows_a][:, kb]) @ (mat2.float() * sb_t[kb][:, cols_b])).to(out_dtype)


def _run_linear(backend, x, w, precision, first):
    y = backend.linear(x, w, precision, is_first_microbatch=first)
    y.float().sum().backward()
    return y.detach()


@pytest.fixture
def block_support(monkeypatch):
    """fp8_block's scaled-mm as if the device ran it (CPU refuses block scales; ``_Calls`` computes them)."""
    monkeypatch.setattr(scaled_mm, "scaled_mm_support", lambda *a, **k: (True, "test"))


# --- out_dtype and fast accumulation, checked against the meta registration ------------------------
@needs_cpu_fp8
def test_fp8_calls_write_the_activation_dtype_with_fast_accum_for_fprop_only(monkeypatch):
    scaled_mm.scaled_mm_support("fp8", "cpu", cpu_reference=True)  # the probe before the recorder
    for a, b in OPERAND_PAIRS:
        scaled_mm.scaled_mm_support("fp8", "cpu", a, b, cpu_reference=True)
    rec = _Calls(monkeypatch)
    backend = TorchBackend(cpu_reference=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(80, 96, generator=g) * 0.1).requires_grad_(True)
    y = _run_linear(backend, x, w, GemmPrecision.uniform("fp8"), None)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert [(c["out_dtype"], c["fast"], c["k"]) for c in rec.calls] == [
        (torch.bfloat16, True, 96),  # fprop: Y in the activation dtype, fast accumulation (TE's fprop)
        (torch.bfloat16, False, 80),  # dgrad: dX in x's dtype, split accumulation
        (torch.float32, False, 64),  # wgrad: fp32 main gradient, split accumulation
    ]
    assert backend.fallbacks == {}


def test_fast_accum_pairs_follow_transformer_engine():
    act, wt, grad = Operand.ACTIVATION, Operand.WEIGHT, Operand.GRADIENT
    assert fast_accum_for("fp8", act, wt) and not fast_accum_for("fp8", grad, wt)
    assert not fast_accum_for("fp8", grad, act) and not fast_accum_for("fp8_block", act, wt)


def test_fast_accum_bound_is_the_derived_one():
    # split: sqrt(K) 2^-13; fast: (2/3) rho sqrt(K) 2^-13 (1 + 1/K)^1.5, never below split
    assert accumulation_tolerance(512) == math.sqrt(512) * 2.0**-13
    assert accumulation_tolerance(512, True, 2.842) == pytest.approx(2 / 3 * 2.842 * math.sqrt(512) * 2.0**-13
                                                                     * (1 + 1 / 512) ** 1.5)
    assert accumulation_tolerance(512, True, 1.0) == accumulation_tolerance(512)


def test_fp8_block_calls_meet_the_meta_registration(monkeypatch, block_support):
    rec = _Calls(monkeypatch)
    runner = ScaledMMGemm(cpu_reference=True)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(256, 512, generator=g).bfloat16(), torch.randn(384, 512, generator=g)
    kw = {"hadamard": False, "amax_reduce": None, "generator": None, "compiled": False}
    got = runner("fp8_block", a, Operand.ACTIVATION, b, Operand.WEIGHT, out_dtype=torch.bfloat16, **kw)
    want = emulated_gemm("fp8_block", a, Operand.ACTIVATION, b, Operand.WEIGHT, **kw)
    assert rec.calls[-1]["api"] == "_scaled_mm" and rec.calls[-1]["out_dtype"] == torch.bfloat16
    assert not rec.calls[-1]["fast"] and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2**-8, atol=1e-6)  # one bf16 rounding of the same product


# --- padded 128x128 scales -----------------------------------------------------------------------------
@pytest.mark.skipif(not padded_scale_api()[0], reason=f"this torch: {padded_scale_api()[1]}")
@pytest.mark.parametrize("n", [1280, 5504])  # the 70B qkv dgrad at TP=8, the 7B fc1 dgrad at TP=4: K/128 = 10, 43
def test_dgrad_with_k_over_128_not_a_multiple_of_4_runs_padded(monkeypatch, block_support, n):
    rec = _Calls(monkeypatch)
    backend = TorchBackend(cpu_reference=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 256, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(n, 256, generator=g) * 0.05).requires_grad_(True)
    y = backend.linear(x, w, GemmPrecision("fp8_block", "fp8_block", "bf16"))
    dy = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(dy)
    dgrad = [c for c in rec.calls if c["k"] == n]
    assert len(dgrad) == 1 and dgrad[0]["api"] == "F.scaled_mm"
    assert dgrad[0]["recipes"] == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
    lk = n // 128
    l4 = -(-lk // 4) * 4
    assert dgrad[0]["scale_b"].shape == (l4, 256 // 128) and dgrad[0]["scale_b"].stride() == (1, l4)
    assert backend.fallbacks == {}
    want = emulated_gemm("fp8_block", dy, Operand.GRADIENT, w.detach().t(), Operand.WEIGHT, hadamard=False,
                         amax_reduce=None, generator=None, compiled=False)
    assert torch.allclose(x.grad.float(), want, rtol=2**-8, atol=1e-5 * want.abs().max().item())


def test_without_the_padded_api_it_falls_back_with_the_reason(monkeypatch):
    monkeypatch.delattr(F, "scaled_mm")
    ok, why = padded_scale_api()
    assert not ok and "torch.nn.functional.scaled_mm" in why
    err = scaled_mm_shape_error("fp8_block", (256, 1280), Operand.GRADIENT, (256, 1280), Operand.WEIGHT,
                                torch.device("cuda"))
    assert err and "multiple of 4" in err and why in err


def test_capability_is_read_from_the_signature(monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", lambda mat_a, mat_b, scale_a, scale_b, out_dtype=None: None)
    ok, why = padded_scale_api()
    assert not ok and "scale_recipe_a" in why


# --- one weight quantization per step ------------------------------------------------------------------
def _counting(monkeypatch):
    """Every quantize_scaled call of a weight operand, by the scaled-mm runner."""
    seen = []
    real = scaled_mm.quantize_scaled

    def count(x, fmt, operand, **kw):
        if operand is Operand.WEIGHT:
            seen.append(tuple(x.shape))
        return real(x, fmt, operand, **kw)

    monkeypatch.setattr(scaled_mm, "quantize_scaled", count)
    return seen


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block"])
def test_each_weight_is_quantized_once_per_step_and_again_after_an_update(monkeypatch, block_support, fmt):
    _Calls(monkeypatch)
    seen = _counting(monkeypatch)
    cached, fresh = TorchBackend(cpu_reference=True), TorchBackend(cpu_reference=True)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(256, 128, generator=g) * 0.1).requires_grad_(True)
    w_fresh = w.detach().clone().requires_grad_(True)
    copy = WeightCopy()
    prec = GemmPrecision(fmt, fmt, "bf16")
    micro = [torch.randn(128, 128, generator=g).bfloat16() for _ in range(4)]
    for step in range(2):
        copy.open()
        for i, xm in enumerate(micro):
            first = copy.first_microbatch(w, prec)
            assert first is (i == 0)
            y = _run_linear(cached, xm.clone().requires_grad_(True), w, prec, first)
            want = _run_linear(fresh, xm.clone().requires_grad_(True), w_fresh, prec, None)
            assert torch.equal(y, want), (step, i)  # the cached operands are the fresh ones, bit for bit
        copy.close()
        cached.end_step()
        assert torch.equal(w.grad, w_fresh.grad)
        assert cached.weights.counts == {"quantize": step + 1, "transpose": step + 1, "reuse": 6 * (step + 1)}
        with torch.no_grad():  # the optimizer step, between scopes
            w.sub_(0.01 * w.grad)
            w_fresh.sub_(0.01 * w_fresh.grad)
        w.grad = w_fresh.grad = None
    assert seen.count(tuple(w.shape)) == 2 + 4 * 2  # cached: 1 per step; fresh: 1 per micro-batch
    assert seen.count((128, 256)) == 4 * 2  # dgrad's Wᵀ: re-quantized only without the cache


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block"])
def test_an_in_place_update_inside_a_step_invalidates_the_cache(monkeypatch, block_support, fmt):
    _Calls(monkeypatch)
    backend, fresh = TorchBackend(cpu_reference=True), TorchBackend(cpu_reference=True)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 128, generator=g) * 0.1).requires_grad_(True)
    x = torch.randn(128, 128, generator=g).bfloat16()
    prec = GemmPrecision(fmt, fmt, "bf16")
    _run_linear(backend, x.clone().requires_grad_(True), w, prec, True)
    with torch.no_grad():
        w.mul_(3.0)  # bumps w._version; a caller that still says first=False must not get stale codes
    y = _run_linear(backend, x.clone().requires_grad_(True), w, prec, False)
    assert torch.equal(y, _run_linear(fresh, x.clone().requires_grad_(True), w, prec, None))
    assert backend.weights.counts["quantize"] == 2


def test_quantize_once_holds_through_the_model_and_its_step_scope(monkeypatch, block_support):
    """LlamaModel wires it: each linear passes is_first_microbatch from its WeightCopy, and closing the
    step's scope empties the cache (``Backend.end_step``), before any optimizer step."""
    _Calls(monkeypatch)
    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = LlamaModel(cfg, 64)
    backend = TorchBackend(cpu_reference=True)
    model.set_backend(backend)
    for lin in model.precision_linears():
        lin.set_precision(GemmPrecision("fp8_block", "fp8_block", "bf16"))
    tokens = torch.randint(0, 64, (3, 1, 129), generator=torch.Generator().manual_seed(6))
    linears = len(list(model.precision_linears()))
    for step in range(2):
        with model.weight_copies_for_step():
            for mb in tokens:
                model.loss(model(mb[:, :-1]), mb[:, 1:]).backward()
            assert len(backend.weights._entries) == linears
        assert len(backend.weights._entries) == 0  # emptied when the scope closed
        assert backend.weights.counts["quantize"] == linears * (step + 1)  # 1 per weight per step
        assert backend.weights.counts["transpose"] == linears * (step + 1)  # dgrad's from fprop's
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.01 * p.grad)
                p.grad = None


# --- the amax is one pass ------------------------------------------------------------------------------
class _FullSizeOps(TorchDispatchMode):
    """The aten ops that read or write a tensor of ``numel`` elements (a pass over the operand); views
    (detach, transpose) move no data and are left out."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if not func.is_view and any(t.numel() == self.numel for t in tensors):
            self.ops.append(str(func.overloadpacket))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_amax_is_one_pass_without_an_abs_temporary(dtype):
    x = torch.randn(64, 128, dtype=dtype)
    x[3, 5] = -1e3  # the largest magnitude is negative: max(-min, max) must find it
    with _FullSizeOps(x.numel()) as mode:
        amax = tensor_amax(x)
    assert mode.ops == ["aten.aminmax"], mode.ops
    assert amax.dtype == torch.float32 and amax == x.float().abs().amax()
    x[0, 0] = float("nan")
    assert torch.isnan(tensor_amax(x))
    for zeros in (torch.zeros(8, dtype=dtype), -torch.zeros(8, dtype=dtype)):  # +0, not -0 (NVFP4 divides by it)
        assert tensor_amax(zeros).view(torch.int32) == 0


def test_fp8_operand_quantization_reads_x_once_for_its_amax():
    x = torch.randn(64, 128)
    with _FullSizeOps(x.numel()) as mode:
        op = quantize_scaled(x, "fp8", Operand.ACTIVATION)
    assert "aten.abs" not in mode.ops and mode.ops.count("aten.aminmax") == 1, mode.ops
    assert torch.equal(dequantize(op), dequantize(quantize_scaled(x.clone(), "fp8", Operand.ACTIVATION)))
