"""gpu_check's one-line probes say the right answer for each behaviour the GPU may show.

The GPU's answer cannot be had on CPU, so each probe's logic runs here against stand-ins for the
behaviours it tells apart: ``scale_pad`` against a scaled-mm that reads the 128x128 scales through
the strides it is given (no padding needed) and one that reads their storage with K/128 padded to
4 (cuBLAS's documented layout), ``div_rn_ftz`` under the Triton interpreter (IEEE: keeps
subnormals), ``stop_flag`` on CPU (no answer there: INFO).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_probes as probes


def _fake_scaled_mm(padded_reads: bool):
    """torch._scaled_mm for 1x128 x 128x128 scales in float: scale_b (K/128, N/128) read through its
    strides, or (``padded_reads``) from its storage with a row stride of K/128 rounded up to 4."""
    def mm(a, b, scale_a, scale_b, out_dtype=torch.float32):
        kb, nb = scale_b.shape
        if padded_reads:
            scale_b = scale_b.as_strided((kb, nb), (1, -(-kb // 4) * 4))
        a_deq = a.float() * scale_a.repeat_interleave(128, dim=1)
        b_deq = b.float() * scale_b.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
        return (a_deq @ b_deq).to(out_dtype)
    return mm


def _refuse(*args, **kwargs):
    raise RuntimeError("not here")


@pytest.mark.parametrize(("padded_reads", "answer"), [
    (False, "no padding needed"),
    (True, "padding needed; right with _scaled_mm padded"),
])
def test_scale_pad_tells_the_layouts_apart(monkeypatch, padded_reads, answer):
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(padded_reads))
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", _refuse)
    figure, status = probes.probe_scale_padding(torch.device("cpu"))
    assert status == "INFO" and figure.split(" -> ")[-1].startswith(answer), figure
    assert ("_scaled_mm unpadded: WRONG" in figure) == padded_reads
    assert "scaled_mm v2 padded: refused" in figure


def test_scale_pad_says_unknown_when_every_call_is_refused(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _refuse)
    figure, _ = probes.probe_scale_padding(torch.device("cpu"))
    assert figure.endswith("(unknown)"), figure


def test_div_rn_ftz_keeps_subnormals_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    figure, status = probes.probe_div_rn_ftz(torch.device("cpu"))
    assert status == "INFO" and "kernels' options (enable_fp_fusion=False): keeps subnormals" in figure, figure


def test_stop_flag_has_no_answer_on_cpu():
    figure, status = probes.probe_stop_flag(torch.device("cpu"))
    assert status == "INFO" and "needs a GPU" in figure
