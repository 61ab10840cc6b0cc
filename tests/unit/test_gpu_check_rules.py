"""gpu_check's design rules, checked on CPU (#34 item 1): the budgets fit the script's limits, the
checks run in order of value, a fast-path fallback the device should not need is a FAIL, and a cut
(SIGINT, a budget's alarm) stays a cut when a library re-raises it as another exception.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_snip.precision import fallbacks
from megatron_snip.precision.backends.scaled_mm import CPU_REASON
from megatron_snip.precision.quantize import compiled

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check
import gpu_check_report as report
from gpu_check_report import fast_path_verdicts


def _timeouts() -> dict[str, tuple[int, int]]:
    """script -> (limit s, kill-after s) of each ``timeout`` line in gpu_check.sh."""
    text = (ROOT / "scripts/gpu_check.sh").read_text()
    found = re.findall(r"^timeout --signal=INT --kill-after=(\d+) (\d+) python3 scripts/(\S+)\.py", text, re.MULTILINE)
    return {script: (int(limit), int(kill)) for kill, limit, script in found}


def test_the_budgets_bound_the_script_to_six_minutes():
    limits = _timeouts()
    assert set(limits) == {"gpu_check", "gpu_time_ratios"}, limits
    assert limits["gpu_check"][0] == gpu_check.PY_LIMIT_S
    assert sum(gpu_check.BUDGET_S.values()) + gpu_check.STARTUP_S <= gpu_check.PY_LIMIT_S
    assert sum(limit + kill for limit, kill in limits.values()) <= gpu_check.SCRIPT_LIMIT_S == 360
    assert gpu_check.COMPILE_START_S < gpu_check.BUDGET_S["compiled"]


def test_the_checks_run_in_order_of_value():
    order = [c.check_name for c in gpu_check.CHECKS]
    assert order == list(gpu_check.BUDGET_S)
    numerics, scaled_mm, timings = ("bitwise", "scaled_op"), ("scaled_mm", "gemms"), ("bandwidth", "steps")
    assert max(map(order.index, numerics)) < min(map(order.index, scaled_mm))
    assert max(map(order.index, scaled_mm)) < order.index("probes") < order.index("tiny_snip")
    assert order[-len(timings):] == list(timings)


@pytest.fixture
def fresh_fallbacks(monkeypatch, tmp_path):
    monkeypatch.setattr(fallbacks, "_RECORDED", {})
    monkeypatch.setattr(fallbacks, "_UNLOGGED", [])
    monkeypatch.setattr(compiled, "_KERNELS", [])
    monkeypatch.setattr(compiled, "_COMPILE_ERROR", [])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the retry's private cache dir


def _statuses(device: str, backend_fallbacks=None, expected=lambda fmt: fmt == "fp8") -> list[str]:
    return [s for _, s in fast_path_verdicts(fallbacks.recorded(), torch.device(device), expected, backend_fallbacks)]


def test_a_kernel_fallback_fails_on_cuda_only(fresh_fallbacks):
    with pytest.warns(RuntimeWarning):
        compiled.kernel_failed(RuntimeError("ptxas died"))  # as _run_qdq records a failed launch
    assert _statuses("cuda") == ["FAIL"]
    assert _statuses("cpu") == ["INFO"]


def test_a_compile_fallback_fails_on_cuda(fresh_fallbacks, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor crashed")

    monkeypatch.setattr(compiled, "_get_compiled", broken)
    from megatron_snip.precision.formats import Operand, get_format

    with pytest.warns(RuntimeWarning):
        assert compiled._run_compiled(torch.zeros(16, 32), get_format("fp8"), Operand.ACTIVATION, False, False,
                                      None, None) is None
    assert _statuses("cuda") == ["FAIL"]


def test_a_scaled_mm_fallback_fails_where_it_is_expected(fresh_fallbacks):
    refused = {"fp8 activation x weight on cuda:0": "torch._scaled_mm refused it: RuntimeError: no",
               "nvfp4 activation x weight on cuda:0": "no scaled-mm path for nvfp4"}
    assert _statuses("cuda", refused) == ["FAIL", "INFO"]
    by_design = {"fp8 activation x weight on cpu": CPU_REASON}  # the torch backend on CPU, as documented
    assert _statuses("cpu", by_design) == ["INFO"]
    assert _statuses("cuda", {}) == []


def _disguised(exc_type):
    """A check whose library turns the signal's exception into a TypeError, as torch's argument parser
    did to a SIGINT under Triton's interpreter (CI: "raised InterpreterError: TypeError(...)")."""
    def check_disguised(device, smoke):
        try:
            if exc_type is KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the signal's handler raises in here
        except exc_type:
            raise TypeError("expected a sequence of integers or a single integer") from None
        raise AssertionError("no signal arrived within 5 s")
    return report.guarded(check_disguised)


@pytest.fixture
def fresh_report(monkeypatch):
    for name in ("FAILED", "CURRENT", "SIGNALLED"):
        monkeypatch.setattr(report, name, [])
    monkeypatch.setattr(report, "SECONDS", {})
    monkeypatch.setattr(report, "STATUS", {})
    old = signal.signal(signal.SIGINT, report.on_sigint)
    yield
    signal.signal(signal.SIGINT, old)


def test_a_sigint_a_library_disguised_still_cuts_the_run(fresh_report):
    with pytest.raises(KeyboardInterrupt):
        _disguised(KeyboardInterrupt)(None, True)
    assert report.CURRENT == ["disguised"] and "disguised" in report.SECONDS  # main() names the check
    assert report.FAILED == []  # no "raised TypeError" line


def test_a_budget_alarm_a_library_disguised_is_still_a_cut(fresh_report, capsys):
    _disguised(report.OverBudget)(None, True, budget_s=0.05)
    out = capsys.readouterr().out
    assert "cut at its 0.05 s budget" in out and "raised" not in out, out
    assert report.FAILED == ["disguised"]


def test_a_sigint_a_library_dropped_still_cuts_the_run(fresh_report):
    @report.guarded
    def check_dropped(device, smoke):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # a library's ``except BaseException: pass`` around a call
    with pytest.raises(KeyboardInterrupt):
        check_dropped(None, True)
