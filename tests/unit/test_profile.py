"""``training.profile_steps`` (issue #36 item 5): a torch.profiler trace of chosen steps, its quantizer and
GEMM regions labelled by format, and nothing of it when off."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_snip.config import load_config
from megatron_snip.precision import profile_labels
from megatron_snip.precision.gemm import quant_linear
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.telemetry.profile import trace_path
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"


def _names(trace_file):
    events = json.loads(trace_file.read_text())["traceEvents"]  # Chrome trace JSON, as Perfetto reads it
    return [e["name"] for e in events if e.get("ph") == "X"]


def test_a_trace_of_the_chosen_steps_is_written_per_rank_with_labelled_regions(small_overrides, tmp_path):
    cfg = load_config(TINY, small_overrides + ["training.max_steps=4", "training.profile_steps=[2,3]",
                                              "precision.initial_plan=uniform:nvfp4"])
    trainer = Trainer(cfg)
    trainer.fit()
    trainer.logger.close()
    path = trace_path(tmp_path / "run", 0)
    assert path == tmp_path / "run" / "profile" / "trace_rank0.json" and path.is_file()
    names = _names(path)
    assert [n for n in names if n.startswith("step:")] == ["step:2", "step:3"]
    # 2 steps x 2 layers x 4 linears: one region per GEMM, two quantizations inside each.
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert names.count(f"gemm:{gemm}:nvfp4") == 16, (gemm, sorted(set(names)))
    for operand in ("activation", "weight", "gradient"):
        assert names.count(f"quantize:nvfp4:{operand}") == 32, operand


def test_each_gemm_and_quantizer_is_named_by_its_own_format():
    x = torch.randn(128, 128, requires_grad=True)  # fp4_block's 128-blocks along K, N and the tokens
    w = torch.randn(128, 128, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        quant_linear(x, w, GemmPrecision(fprop="fp8", dgrad="mxfp8", wgrad="fp4_block")).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert {"gemm:fprop:fp8", "gemm:dgrad:mxfp8", "gemm:wgrad:fp4_block", "quantize:fp8:activation",
            "quantize:fp8:weight", "quantize:mxfp8:gradient", "quantize:mxfp8:weight",
            "quantize:fp4_block:gradient", "quantize:fp4_block:activation"} <= names, sorted(names)


def test_off_no_record_function_is_created(monkeypatch):
    """Without a profiler the labels are a shared no-op context: no RecordFunction, no name formatted."""
    def refuse(name):
        raise AssertionError(f"record_function({name!r}) created while not profiling")

    monkeypatch.setattr(profile_labels._profiler, "record_function", refuse)
    x = torch.randn(32, 64, requires_grad=True)
    quant_linear(x, torch.randn(64, 64), GemmPrecision(fprop="nvfp4", dgrad="nvfp4", wgrad="nvfp4")).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]), pytest.raises(AssertionError, match="quantize:nvfp4"):
        profile_labels.label("quantize", "nvfp4", "activation")  # ... and the same label does one while profiling


@pytest.mark.parametrize("value", ["[0,2]", "[3,2]", "[2,5]", "[2]", "[1,2,3]"])
def test_bad_profile_steps_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"training\.profile_steps=.*give \[start, end\] with 1 <= start <= end <= "
                                         r"training\.max_steps=4"):
        load_config(TINY, ["training.max_steps=4", f"training.profile_steps={value}"])
