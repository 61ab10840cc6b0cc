"""Backend capability rules and the Backend interface, on CPU.

The TE rules are exercised by substituting the probes (TE importable? CUDA?
compute capability?), since this machine has neither TE nor a GPU.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.precision import capability
from megatron_snip.precision.backends import Backend, get_backend, support
from megatron_snip.precision.backends.support import check, require
from megatron_snip.precision.backends.te import make_recipe, uniform_format
from megatron_snip.precision.capability import Capability
from megatron_snip.precision.formats import FORMATS
from megatron_snip.precision.gemm import quant_linear
from megatron_snip.precision.plan import GemmPrecision


def test_emulated_runs_everything_everywhere():
    for fmt in FORMATS:
        assert check("emulated", fmt).ok
        assert check("emulated", fmt, "cpu")
    require("emulated", FORMATS, torch.device("cpu"))


def test_te_unavailable_here_says_why():
    # This machine: no transformer_engine (or, if someone installed it, no CUDA).
    if support._te_import_error() is None and torch.cuda.is_available():
        pytest.skip("TE and CUDA present: covered by tests/gpu/test_te_backend.py")
    for fmt in ("bf16", "fp8", "nvfp4"):
        cap = check("te", fmt)
        assert not cap and (
            cap.reason.startswith("transformer_engine not importable:") or cap.reason.startswith("CUDA not available")
        ), cap.reason
    assert "no mxfp4 recipe" in check("te", "mxfp4").reason
    with pytest.raises(ValueError, match=r'precision.backend=\\?"emulated"') as e:
        require("te", ["nvfp4", "fp8"])
    assert "nvfp4" in str(e.value) and "fp8" in str(e.value)


def test_bad_names_are_value_errors():
    with pytest.raises(ValueError, match="precision.backend='cutlass'"):
        check("cutlass", "fp8")
    with pytest.raises(ValueError, match="unknown precision format 'fp6'"):
        check("te", "fp6")
    with pytest.raises(ValueError, match="not one of"):
        get_backend("cutlass")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend TE imports and CUDA works, with a settable compute capability."""
    state = {"cc": (9, 0)}
    monkeypatch.setattr(support, "_te_import_error", lambda: None)
    monkeypatch.setattr(support, "_cuda_available", lambda: True)
    monkeypatch.setattr(support, "_compute_capability", lambda dev: state["cc"])
    monkeypatch.setattr(support, "_te_reports", lambda fmt: None)
    return state


@pytest.mark.parametrize(
    "cc,ok",
    [
        ((7, 5), set()),
        ((8, 0), {"bf16"}),
        ((8, 9), {"bf16", "fp8"}),
        ((9, 0), {"bf16", "fp8", "fp8_block"}),
        ((10, 0), {"bf16", "fp8", "fp8_block", "mxfp8", "nvfp4"}),
    ],
)
def test_te_compute_capability_rules(fake_gpu, cc, ok):
    fake_gpu["cc"] = cc
    dev = torch.device("cuda", 0)
    for fmt in FORMATS:
        cap = check("te", fmt, dev)
        assert cap.ok == (fmt in ok), (cc, fmt, cap.reason)
        if not cap.ok and fmt not in ("mxfp4", "fp4_block"):
            assert f"{cc[0]}.{cc[1]}" in cap.reason and "needs compute capability" in cap.reason
        elif fmt in ("mxfp4", "fp4_block"):
            assert "no " + fmt + " recipe" in cap.reason
    assert not check("te", "fp8", "cpu").ok  # TE needs a CUDA device
    variant = check("te", "nvfp4-sr", dev)  # recipe variants: emulated only, whatever the GPU
    assert not variant and "recipe variant" in variant.reason and check("emulated", "nvfp4-sr").ok


def test_te_own_verdict_is_reported(fake_gpu, monkeypatch):
    fake_gpu["cc"] = (10, 0)
    monkeypatch.setattr(support, "_te_reports", lambda fmt: (False, "cuBLASLt too old"))
    cap = check("te", "nvfp4", "cuda:0")
    assert not cap and "cuBLASLt too old" in cap.reason


def test_gpu_type_rules(fake_gpu):
    """The dry run's check of a GPU type that is not here follows the start-up check's rules."""
    h100, b200 = capability.GPUS["h100"], capability.GPUS["b200"]
    assert capability.check_gpu_type("te", "fp8", capability.GPUS["a100"]).ok is False
    assert capability.check_gpu_type("te", "mxfp8", h100).ok is False and capability.check_gpu_type("te", "mxfp8", b200)
    assert capability.check_gpu_type("te", "mxfp4", b200).ok is False  # no TE recipe at all
    assert capability.check_gpu_type("emulated", "mxfp4", h100)
    for gpu in capability.GPUS.values():  # the same verdicts as on a device of that compute capability
        fake_gpu["cc"] = gpu.sm
        for fmt in FORMATS:
            assert capability.check_gpu_type("te", fmt, gpu).ok == check("te", fmt, "cuda:0").ok, (gpu, fmt)


def test_capability_is_truthy():
    assert Capability(True) and not Capability(False, "x")


def test_emulated_backend_is_quant_linear():
    backend = get_backend("emulated")
    assert isinstance(backend, Backend) and backend.name == "emulated"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    p = GemmPrecision("nvfp4", "fp8", "mxfp8")
    assert torch.equal(backend.linear(x, w, p), quant_linear(x, w, p))


def test_te_backend_refuses_cleanly_without_te():
    backend = get_backend("te")
    assert backend.name == "te"
    ok, reason = backend.supports("fp8", "cpu")
    assert not ok and reason
    w = torch.nn.Parameter(torch.randn(48, 64))
    with pytest.raises(ValueError, match="te backend cannot run fp8"):
        backend.linear(torch.randn(32, 64), w, GemmPrecision.uniform("fp8"))
    with pytest.raises(ValueError, match="one recipe per linear"):
        uniform_format(GemmPrecision("nvfp4", "fp8", "fp8"))
    assert uniform_format(GemmPrecision.uniform("mxfp8")) == "mxfp8"
    assert make_recipe("bf16") is None
    with pytest.raises(ValueError, match="no Transformer Engine recipe"):
        make_recipe("mxfp4")
