"""The torch backend on CPU: scaled-mm operands are the reference quantization bit for bit, and
its GEMMs equal the emulated ones within fp32-accumulation tolerance; unsupported scalings fall
back to the emulated GEMM for that GEMM only, recorded once.

CPU torch 2.13 runs tensor-wise FP8 scaled-mm (so ``fp8`` is tested for real here, through the
backend's ``cpu_reference`` option: a training run on CPU runs the emulated GEMM, said at
start-up); block, MX and NVFP4 scalings are refused on CPU, so their scaled-mm paths are
exercised only on a GPU (tests/gpu/test_torch_backend.py), here only their recorded fallback
is, and the fp8_block layout is checked against PyTorch's contract in test_scaled_mm_contract.py.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from megatron_snip.precision import fallbacks
from megatron_snip.precision.backends import get_backend
from megatron_snip.precision.backends.scaled_mm import CPU_REASON, ScaledMMGemm, scaled_mm_support
from megatron_snip.precision.backends.support import check
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.gemm import emulated_gemm
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize import quantize
from megatron_snip.precision.quantize.scaled import SCALED_FORMATS, dequantize, quantize_scaled
from megatron_snip.precision.scaled_mm_rules import OPERAND_PAIRS

CPU_FP8 = scaled_mm_support("fp8", "cpu", cpu_reference=True)[0]
needs_cpu_fp8 = pytest.mark.skipif(not CPU_FP8, reason=f"this torch has no CPU FP8 scaled-mm: "
                                                       f"{scaled_mm_support('fp8', 'cpu', cpu_reference=True)[1]}")


def reference_backend():
    """The torch backend with CPU's reference scaled-mm switched on (numerics tests only)."""
    return get_backend("torch", cpu_reference=True)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na].contiguous().view(torch.int32), b[~nb].contiguous().view(torch.int32))


def input_classes(rows: int = 128, cols: int = 256) -> dict[str, torch.Tensor]:
    """The reference tests' input classes: plain, outliers, all-zero blocks, subnormals, midpoints, NaN/Inf."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).mul(10).exp2()
    out = {"gaussian": x}
    y = x.clone()
    y[5, 7] = 3e4
    out["outlier"] = y
    z = x.clone()
    z[:, :128] = 0
    out["zero_blocks"] = z
    out["subnormal"] = torch.randn(rows, cols, generator=g) * 2.0**-130
    out["midpoints"] = torch.full((rows, cols), 1.0625) * torch.randint(-3, 4, (rows, cols), generator=g)  # E4M3 ties
    n = x.clone()
    n[0, 0], n[130 % rows, 200] = float("nan"), float("inf")
    out["nan_inf"] = n
    out["bf16"] = x.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
@pytest.mark.parametrize("kind", list(Operand))
def test_scaled_operands_are_the_reference_quantization(fmt, kind):
    for name, x in input_classes().items():
        for view in (x, x.t().contiguous().t()):  # contiguous and a transposed (colwise) layout
            op = quantize_scaled(view, fmt, kind)
            assert op.elements.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and op.elements.is_contiguous()
            assert bits_equal(dequantize(op), quantize(view, fmt, kind)), (fmt, kind, name)
    x = input_classes(256, 256)["gaussian"]
    shard_max = lambda a: torch.maximum(a, x.abs().amax())
    assert bits_equal(dequantize(quantize_scaled(x[:128], fmt, kind, amax_reduce=shard_max)),
                      quantize(x[:128], fmt, kind, amax_reduce=shard_max))
    with pytest.raises(ValueError, match="not one of"):
        quantize_scaled(x, "nvfp4", kind)


@needs_cpu_fp8
def test_fp8_gemms_match_the_emulated_gemm():
    runner = ScaledMMGemm(cpu_reference=True)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g) * 0.05
    for a_kind, b_kind in OPERAND_PAIRS:
        kw = {"hadamard": False, "amax_reduce": None, "generator": None, "compiled": False}
        got, want = runner("fp8", a, a_kind, b, b_kind, **kw), emulated_gemm("fp8", a, a_kind, b, b_kind, **kw)
        # fp32 accumulation of the same products; only summation order and scale rounding may differ
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (a_kind, b_kind)
        assert got.dtype == torch.float32
    assert runner.fallbacks == {}


def _run(backend, x, w, dy, precision, seed=5):
    x = x.clone().requires_grad_(True)
    w = torch.nn.Parameter(w.clone())
    y = backend.linear(x, w, precision, generator=torch.Generator().manual_seed(seed))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@needs_cpu_fp8
def test_per_gemm_plan_runs_each_gemm_in_its_format_and_records_fallbacks_once():
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(2, 64, 128, generator=g), torch.randn(128, 128, generator=g) / 11, torch.randn(2, 64, 128, generator=g)
    torch_be, emulated = reference_backend(), get_backend("emulated")
    mixed = GemmPrecision("fp8", "nvfp4", "fp8_block")  # real fp8 fprop; nvfp4 (SR) and fp8_block emulated on CPU
    got = _run(torch_be, x, w, dy, mixed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(torch_be, x, w, dy, mixed)  # a second step records and warns no more
    assert not [w_ for w_ in caught if "runs the emulated GEMM" in str(w_.message)]
    want = _run(emulated, x, w, dy, mixed)
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-5 * want[0].abs().max().item())
    assert bits_equal(got[1], want[1]) and bits_equal(got[2], want[2])  # fallbacks are the emulated GEMM itself
    assert sorted(torch_be.fallbacks) == ["fp8_block gradient x activation on cpu", "nvfp4 gradient x weight on cpu"]
    assert "no scaled-mm path for nvfp4" in torch_be.fallbacks["nvfp4 gradient x weight on cpu"]
    assert "Invalid scaling configuration" in torch_be.fallbacks["fp8_block gradient x activation on cpu"]
    logged = fallbacks.recorded()
    assert "torch backend nvfp4 gradient x weight on cpu runs the emulated GEMM" in logged
    assert "torch backend fp8_block gradient x activation on cpu runs the emulated GEMM" in logged


def test_autocast_does_not_change_the_torch_backend_gemms():
    if not CPU_FP8:
        pytest.skip("this torch has no CPU FP8 scaled-mm")
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(64, 128, generator=g), torch.randn(128, 128, generator=g) / 11, torch.randn(64, 128, generator=g)
    p = GemmPrecision.uniform("fp8")
    plain = _run(reference_backend(), x, w, dy, p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = _run(reference_backend(), x, w, dy.bfloat16(), p)
    assert cast[0].dtype == torch.bfloat16 and torch.equal(cast[0], plain[0].bfloat16())
    assert torch.equal(cast[2], _run(reference_backend(), x, w, dy.bfloat16().float(), p)[2])


def test_capability_says_the_torch_backend_runs_emulated_on_cpu():
    for fmt in ("fp8", "fp8_block", "mxfp8", "nvfp4", "mxfp4"):
        cap = check("torch", fmt, "cpu")
        assert cap.ok and "emulated GEMM fallback" in cap.reason and CPU_REASON in cap.reason, fmt
    assert "torch backend on cpu runs every GEMM emulated" in fallbacks.recorded()


def test_the_torch_backend_on_cpu_is_the_emulated_backend():
    g = torch.Generator().manual_seed(6)
    x, w, dy = torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g) / 11, torch.randn(128, 128, generator=g)
    for p in (GemmPrecision.uniform("fp8"), GemmPrecision("fp8", "nvfp4", "fp8_block")):
        torch_be = get_backend("torch")
        got, want = _run(torch_be, x, w, dy, p), _run(get_backend("emulated"), x, w, dy, p)
        assert all(bits_equal(a, b) for a, b in zip(got, want))
        assert torch_be.fallbacks and all(r == CPU_REASON for r in torch_be.fallbacks.values())


def test_trainer_on_cpu_says_at_start_up_that_the_torch_backend_runs_emulated(small_overrides, monkeypatch):
    from megatron_snip.config import load_config
    from megatron_snip.training.trainer import Trainer

    monkeypatch.setattr(fallbacks, "_RECORDED", {})  # this process may have said it before
    monkeypatch.setattr(fallbacks, "_UNLOGGED", [])
    cfg = load_config("launch/configs/tiny.toml", small_overrides + [
        "precision.backend=torch", "precision.initial_plan=uniform:fp8", "training.max_steps=2"])
    tr = Trainer(cfg)
    assert f"fallback: torch backend on cpu runs every GEMM emulated: {CPU_REASON}" in fallbacks.drain()
    tr.fit()
    tr.logger.close()
    assert all(lin.backend.name == "torch" for lin in tr.model.precision_linears())
    ran = tr.model.precision_linears().__next__().backend.fallbacks
    assert sorted(ran) == sorted(f"fp8 {a.value} x {b.value} on cpu" for a, b in OPERAND_PAIRS)
    assert set(ran.values()) == {CPU_REASON}
    rows = [json.loads(line) for line in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert tr.step == 2 and losses and all(math.isfinite(v) for v in losses)


@needs_cpu_fp8
def test_a_refused_gemm_falls_back_without_a_second_amax_reduction(monkeypatch):
    from megatron_snip.precision.backends import scaled_mm

    def refuse(a, b, **kw):
        raise RuntimeError("mat2 must be col_major")

    monkeypatch.setattr(scaled_mm, "_mm", refuse)
    runner = ScaledMMGemm(cpu_reference=True)
    calls = []
    reduce = lambda amax: calls.append(1) or amax
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    kw = {"hadamard": False, "generator": None, "compiled": False}
    got = runner("fp8", a, Operand.ACTIVATION, b, Operand.WEIGHT, amax_reduce=reduce, **kw)
    assert len(calls) == 2  # once per operand, as the emulated GEMM does
    want = emulated_gemm("fp8", a, Operand.ACTIVATION, b, Operand.WEIGHT, amax_reduce=None, **kw)
    assert bits_equal(got, want) and "col_major" in runner.fallbacks["fp8 activation x weight on cpu"]


def test_dry_run_sizing_knows_the_torch_backend():
    from megatron_snip.precision.capability import GPUS, check_gpu_type

    h100, a100 = GPUS["h100"], GPUS["a100"]
    fp8 = check_gpu_type("torch", "fp8", h100)
    assert (fp8.ok, fp8.reason) == (True, f"torch scaled-mm on {h100.name}")
    fp8_block = check_gpu_type("torch", "fp8_block", a100)
    assert fp8_block.ok and "emulated" in fp8_block.reason
    assert "emulated" in check_gpu_type("torch", "nvfp4", h100).reason
