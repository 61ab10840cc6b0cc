"""The torch backend's scaled-mm calls against PyTorch's documented contract, and the probe's tolerance.

CPU torch refuses 1x128 / 128x128 block scaling, so the fp8_block calls are checked where they
can be on CPU:
  * torch's own meta registration of ``_scaled_mm`` (meta tensors are checked as CUDA ones:
    mat1 row-major, mat2 column-major, dims multiples of 16, and the scale shapes: "scale_b
    should be (K/128, N/128)" / "(K/128, N)");
  * the strides ``ScaledBlas.cpp`` requires (``is_blockwise_1x128_scaling``,
    ``is_blockwise_128x128_scaling``, checked on ``scale_a`` for mat1 and on ``scale_b.t()`` for
    ``mat2.t()`` by ``get_joint_scaling``), restated below as ``_pytorch_accepts``;
  * the values: a product computed from the call's arguments by the contract's meaning
    (``scale_b[k // 128, n]`` / ``scale_b[k // 128, n // 128]``, as PyTorch's
    ``mm_float8_emulated_block``) equals the emulated GEMM of the same operands.
The probe's bound is checked with an emulated 14-bit accumulator (passes) and with misplaced or
wrong scales (fail).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_snip.precision.backends import scaled_mm
from megatron_snip.precision.backends.scaled_mm import _mm, _probe, accumulation_tolerance, gemm_error
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.quantize.scaled import ScaledOperand, dequantize, quantize_scaled
from megatron_snip.precision.scaled_mm_rules import (
    OPERAND_PAIRS,
    padded_scale_api,
    scaled_mm_expected_on,
    scaled_mm_shape_error,
)

SHAPES = [(256, 512, 384), (128, 1024, 256), (384, 512, 512)]  # (M, K, N): N != K, N == K, M != 128


def _call(fmt, m, k, n, a_kind, b_kind):
    """The arguments ``_mm`` hands to torch._scaled_mm for a (M, K) · b (N, K)ᵀ, and the operands."""
    g = torch.Generator().manual_seed(m + k + n)
    qa = quantize_scaled(torch.randn(m, k, generator=g), fmt, a_kind)
    qb = quantize_scaled(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).mul(8).exp2(), fmt, b_kind)
    seen = {}

    def record(mat1, mat2, scale_a, scale_b, out_dtype=None, use_fast_accum=False):
        seen.update(mat1=mat1, mat2=mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                    use_fast_accum=use_fast_accum)
        return torch.empty(mat1.shape[0], mat2.shape[1])

    real = torch._scaled_mm
    torch._scaled_mm = record
    try:
        _mm(qa, qb)
    finally:
        torch._scaled_mm = real
    return seen, qa, qb


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _size_stride(scale, dim, size, stride):  # ScaledBlas.cpp check_size_stride
    return scale.shape[dim] == size and (size <= 1 or scale.stride(dim) == stride)


def _is_1x128(t, scale):  # ScaledBlas.cpp is_blockwise_1x128_scaling
    return scale.dtype == torch.float32 and scale.dim() == 2 and _size_stride(scale, 0, t.shape[0], 1) \
        and _size_stride(scale, 1, math.ceil(t.shape[1] / 128), t.shape[0])


def _is_128x128(t, scale):  # ScaledBlas.cpp is_blockwise_128x128_scaling
    lk = math.ceil(t.shape[1] / 128)
    return scale.dtype == torch.float32 and scale.dim() == 2 \
        and _size_stride(scale, 0, math.ceil(t.shape[0] / 128), lk) and _size_stride(scale, 1, lk, 1)


def _pytorch_accepts(call, a_kind, b_kind) -> bool:
    """ScaledBlas.cpp's get_joint_scaling for the DeepSeek pairs, plus mat1 row-major / mat2 column-major."""
    mat1, mat2, sa, sb = call["mat1"], call["mat2"], call["scale_a"], call["scale_b"]
    recipe = {Operand.WEIGHT: _is_128x128, Operand.ACTIVATION: _is_1x128, Operand.GRADIENT: _is_1x128}
    return (mat1.stride(1) == 1 and mat2.stride(0) == 1 and recipe[a_kind](mat1, sa)
            and recipe[b_kind](mat2.t(), sb.t()))


def _contract_product(call) -> torch.Tensor:
    """mat1 · mat2 with each element scaled as the contract says (PyTorch's mm_float8_emulated_block)."""
    mat1, mat2, sa, sb = (call[k] for k in ("mat1", "mat2", "scale_a", "scale_b"))
    (m, k), n = mat1.shape, mat2.shape[1]
    rows_a = torch.arange(m) // (m // sa.shape[0])  # 1 for 1x128 tiles, 128 for 128x128 blocks
    cols_b = torch.arange(n) // (n // sb.shape[1])
    kb = torch.arange(k) // 128
    a = mat1.float() * sa[rows_a][:, kb]
    b = mat2.float() * sb[kb][:, cols_b]
    return a @ b


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("a_kind,b_kind", OPERAND_PAIRS)
def test_fp8_block_call_meets_pytorchs_contract(m, k, n, a_kind, b_kind):
    call, qa, qb = _call("fp8_block", m, k, n, a_kind, b_kind)
    meta = torch._scaled_mm(*(_meta(call[x]) for x in ("mat1", "mat2", "scale_a", "scale_b")),
                            out_dtype=torch.float32)  # torch's meta registration raises on a wrong layout
    assert meta.shape == (m, n)
    assert _pytorch_accepts(call, a_kind, b_kind)
    want = dequantize(qa) @ dequantize(qb).t()
    got = _contract_product(call)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())  # fp32 summation order only


@pytest.mark.parametrize("a_kind,b_kind", OPERAND_PAIRS)
def test_fp8_call_is_tensorwise(a_kind, b_kind):
    call, _, _ = _call("fp8", 64, 128, 96, a_kind, b_kind)
    assert call["scale_a"].dim() == call["scale_b"].dim() == 0 and call["mat2"].stride(0) == 1
    torch._scaled_mm(*(_meta(call[x]) for x in ("mat1", "mat2", "scale_a", "scale_b")), out_dtype=torch.float32)


def test_the_contract_checks_can_fail():
    """The checks above reject b's scales in a's layout (the layout before issue #22's fix)."""
    call, _, qb = _call("fp8_block", 256, 512, 384, Operand.ACTIVATION, Operand.WEIGHT)
    call["scale_b"] = qb.scale  # (N/128, K/128): a's layout for b
    with pytest.raises(RuntimeError, match="Invalid scaling configuration"):
        torch._scaled_mm(*(_meta(call[x]) for x in ("mat1", "mat2", "scale_a", "scale_b")), out_dtype=torch.float32)
    assert not _pytorch_accepts(call, Operand.ACTIVATION, Operand.WEIGHT)
    call["scale_b"] = qb.scale.t().contiguous()  # the right shape, the wrong strides
    assert not _pytorch_accepts(call, Operand.ACTIVATION, Operand.WEIGHT)


def test_shape_rules_for_cublas():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    act, wt = Operand.ACTIVATION, Operand.WEIGHT
    assert scaled_mm_shape_error("fp8_block", (256, 512), act, (384, 512), wt, cuda) is None
    # K/128 = 10: only the padded-scale API takes it (absent: refused with the reason; present: runs)
    err = scaled_mm_shape_error("fp8_block", (256, 1280), act, (384, 1280), wt, cuda, padded_scales=False)
    assert err and "multiple of 4" in err and "1280" in err
    assert scaled_mm_shape_error("fp8_block", (256, 1280), act, (384, 1280), wt, cuda, padded_scales=True) is None
    assert (scaled_mm_shape_error("fp8_block", (256, 1280), act, (384, 1280), wt, cuda) is None) \
        == padded_scale_api()[0]  # detected from this torch's F.scaled_mm signature
    assert scaled_mm_shape_error("fp8_block", (256, 1280), act, (384, 1280), act, cuda) is None  # 1x128 only
    assert scaled_mm_shape_error("fp8", (256, 1280), act, (384, 1280), wt, cuda) is None
    assert "multiples of 16" in scaled_mm_shape_error("fp8", (256, 40), act, (384, 40), wt, cuda)
    assert scaled_mm_shape_error("fp8_block", (256, 1280), act, (384, 1280), wt, cpu) is None


def test_expected_scaled_mm_follows_pytorchs_device_rules():
    assert scaled_mm_expected_on("fp8", (9, 0), "13.0")[0] and scaled_mm_expected_on("fp8", (8, 9), "12.4")[0]
    assert not scaled_mm_expected_on("fp8", (8, 0), "13.0")[0]
    assert scaled_mm_expected_on("fp8_block", (9, 0), "13.0")[0]
    assert not scaled_mm_expected_on("fp8_block", (9, 0), "12.8")[0]
    assert not scaled_mm_expected_on("fp8_block", (10, 0), "13.0")[0]  # "DeepSeek style ... only SM90"
    assert not scaled_mm_expected_on("nvfp4", (10, 0), "13.0")[0]


# --- the probe's tolerance -------------------------------------------------------------------------
def _truncating_mm(a: torch.Tensor, b: torch.Tensor, bits: int, promote: int | None) -> torch.Tensor:
    """a·bᵀ (exact fp64 products) summed term by term in an accumulator that keeps ``bits``
    significant bits by truncation (a model of FP8 tensor cores), added into fp32 every
    ``promote`` terms (cuBLAS's promotion; None: never)."""
    a64, b64 = a.double(), b.double()
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    acc = torch.zeros_like(out)
    for i in range(a.shape[1]):
        m, e = torch.frexp(acc + a64[:, i:i + 1] * b64[:, i][None, :])
        acc = torch.ldexp(torch.trunc(m * 2.0**bits) / 2.0**bits, e)
        if promote and (i + 1) % promote == 0:
            out, acc = (out + acc).float().double(), torch.zeros_like(acc)
    return (out + acc).float()


def test_accumulation_tolerance_is_sqrt_k_times_2_to_minus_13():
    assert accumulation_tolerance(512) == math.sqrt(512) * 2.0**-13
    assert accumulation_tolerance(4096) == pytest.approx(0.0078125)


@pytest.mark.parametrize("promote", [128, None])
def test_probe_passes_a_gemm_with_14_bit_accumulation(monkeypatch, promote):
    monkeypatch.setattr(scaled_mm, "_mm", lambda a, b, **kw: _truncating_mm(dequantize(a), dequantize(b), 14, promote))
    for a_kind, b_kind in OPERAND_PAIRS:
        ok, reason = _probe("fp8_block", a_kind, b_kind, torch.device("cpu"))
        assert ok, reason


def _misplaced_scales(op: ScaledOperand) -> ScaledOperand:
    """op with its block scales read in the transposed memory order (a wrong layout's effect)."""
    s = op.scale
    return ScaledOperand(op.elements, s.t().contiguous().view(s.shape)) if s.dim() else op


def _one_scale_doubled(op: ScaledOperand) -> ScaledOperand:
    s = op.scale.clone()
    s.view(-1)[s.numel() // 2] *= 2
    return ScaledOperand(op.elements, s)


@pytest.mark.parametrize("corrupt", [_misplaced_scales, _one_scale_doubled])
def test_probe_rejects_a_gemm_with_wrong_scales(monkeypatch, corrupt):
    monkeypatch.setattr(scaled_mm, "_mm", lambda a, b, **kw: dequantize(a) @ dequantize(corrupt(b)).t())
    for a_kind, b_kind in OPERAND_PAIRS:
        ok, reason = _probe("fp8_block", a_kind, b_kind, torch.device("cpu"))
        assert not ok and "disagrees" in reason and "accumulation bound" in reason, reason


def test_gemm_error_is_relative_to_the_absolute_product_per_row_and_column():
    a, b = torch.tensor([[1.0, -1.0]]), torch.tensor([[1.0, 1.0]])  # a·bᵀ = 0, |a|·|b|ᵀ = 2
    assert gemm_error(torch.tensor([[0.5]]), a, b) == 0.25
    a, b = torch.ones(4, 2), torch.ones(3, 2)  # |a|·|b|ᵀ = 2 everywhere; one wrong element
    got = a @ b.t()
    got[1, 2] += 1.0
    assert gemm_error(got, a, b) == pytest.approx(1 / (2 * math.sqrt(3)))  # its row: 1 / ||(2, 2, 2)||


# --- the fast-accumulation bound (fp8 fprop: use_fast_accum=True, no promotion) --------------------------
def test_the_fast_accum_bound_holds_without_promotion_where_the_split_bound_fails(monkeypatch):
    from megatron_snip.precision.backends.scaled_mm import magnitude_ratio

    monkeypatch.setattr(scaled_mm, "_mm", lambda a, b, **kw: _truncating_mm(dequantize(a), dequantize(b), 14, None))
    ok, reason = _probe("fp8", Operand.ACTIVATION, Operand.WEIGHT, torch.device("cpu"), fast_accum=True)
    assert ok, reason
    # at K = 1280 a correct truncating accumulator without promotion exceeds the split bound: the derived
    # fast bound (one-signed truncation errors add up, ~K^1.5) is what fp8 fprop needs
    a, b = scaled_mm._probe_operands(1280)
    qa, qb = quantize_scaled(a, "fp8", Operand.ACTIVATION), quantize_scaled(b, "fp8", Operand.WEIGHT)
    da, db = dequantize(qa), dequantize(qb)
    err = gemm_error(_truncating_mm(da, db, 14, None), da, db)
    assert accumulation_tolerance(1280) < err <= accumulation_tolerance(1280, True, magnitude_ratio(da, db))


def test_the_fast_accum_probe_still_rejects_a_wrong_scale(monkeypatch):
    monkeypatch.setattr(scaled_mm, "_mm", lambda a, b, **kw: dequantize(a) @ dequantize(_one_scale_doubled(b)).t())
    ok, reason = _probe("fp8", Operand.ACTIVATION, Operand.WEIGHT, torch.device("cpu"), fast_accum=True)
    assert not ok and "accumulation bound" in reason, reason
