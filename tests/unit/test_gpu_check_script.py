"""scripts/gpu_check.py cannot pass on fallbacks, and says what it reached when cut: its own --smoke
mode (CPU, toy sizes, the torch backend with CPU's reference scaled-mm) reports a forced scaled-mm
fallback as FAIL lines with the reason and exits non-zero, and passes the same checks without it;
a check past its budget is cut with a FAIL line, and a run stopped by SIGINT (gpu_check.sh's
timeout) prints where it stopped and the budget table.

Only some checks run here (``--only``); the whole smoke run takes minutes on two cores
(``scripts/gpu_check.sh --smoke`` runs them all).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
       "PYTHONUNBUFFERED": "1"}


def _smoke(*extra: str, only: str = "scaled_mm,gemms") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--only", only, *extra],
                          check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def _lines(out: str, name: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(f"{name} ")]


def _budget_row(out: str, check: str) -> list[str]:
    return [ln.split() for ln in _lines(out, "budget") if ln.split()[1] == check]


def test_smoke_passes_the_scaled_mm_checks_on_cpu():
    run = _smoke()
    assert run.returncode == 0, run.stdout + run.stderr
    fp8 = [ln for ln in _lines(run.stdout, "scaled_mm") if ln.split()[1] == "fp8:"]
    assert len(fp8) == 1 and "axw=real gxw=real gxa=real" in fp8[0] and fp8[0].endswith("OK")
    gemm = _lines(run.stdout, "gemm_fp8")
    assert len(gemm) == 1 and "exercised: scaled-mm for fprop, dgrad, wgrad" in gemm[0] and gemm[0].endswith("OK")
    block = _lines(run.stdout, "gemm_fp8_block")  # CPU torch refuses block scales: not expected there
    assert len(block) == 1 and "emulated fallback" in block[0] and "not expected here" in block[0]
    compiles = _lines(run.stdout, "compiles")  # the Triton / torch.compile count
    assert len(compiles) == 1 and "Triton kernel specializations" in compiles[0]
    assert _budget_row(run.stdout, "gemms")[0][-1] == "OK"  # the budget table: budget, seconds, status
    assert _budget_row(run.stdout, "bitwise")[0][-3:] == ["-", "not", "run"]
    assert _lines(run.stdout, "total")[0].endswith("OK")


def test_smoke_fails_on_a_forced_fallback():
    run = _smoke("--force-fallback", only="scaled_mm,gemms,steps")
    assert run.returncode == 1, run.stdout + run.stderr
    fp8 = [ln for ln in _lines(run.stdout, "scaled_mm") if ln.split()[1] == "fp8:"]
    assert len(fp8) == 1 and fp8[0].endswith("FAIL") and "refused on purpose" in fp8[0], fp8
    gemm = _lines(run.stdout, "gemm_fp8")
    assert len(gemm) == 1 and gemm[0].endswith("FAIL") and "emulated fallback" in gemm[0], gemm
    step = [ln for ln in _lines(run.stdout, "step") if "fallback: torch backend fp8" in ln]
    assert step and all(ln.endswith("FAIL") for ln in step), _lines(run.stdout, "step")
    total = _lines(run.stdout, "total")
    assert total and total[0].endswith("FAIL") and all(n in total[0] for n in ("scaled_mm", "gemm_fp8", "step"))


def test_smoke_runs_the_sync_free_check():
    """``check_sync_free`` on CPU: the steady-state steps' only host reads are the foreach AdamW's
    skip flag (one per step), and no pageable host-to-device copy is counted."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    run = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--only", "sync_free"], check=False,
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    (sync,) = _lines(run.stdout, "sync_free")
    assert "3 steady-state steps: 3 host syncs {'read': 3} (allowed 3)" in sync and sync.endswith("OK")


def test_a_check_past_its_budget_is_cut_with_a_fail_line():
    run = _smoke("--budget-scale", "0.001", only="probes")  # 15 ms: cut while it imports
    assert run.returncode == 1, run.stdout + run.stderr
    cut = _lines(run.stdout, "probes")
    assert cut and cut[-1].endswith("FAIL") and "cut at its" in cut[-1], run.stdout
    assert _budget_row(run.stdout, "probes")[0][-1] == "FAIL"


def test_a_run_stopped_by_sigint_prints_where_it_stopped_and_the_table():
    proc = subprocess.Popen([sys.executable, "scripts/gpu_check.py", "--smoke", "--only", "env,bitwise"], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    for ln in proc.stdout:  # env prints at once, then bitwise runs for seconds
        seen.append(ln)
        if ln.startswith("te "):  # env's last line: bitwise starts (and runs for tens of seconds)
            break
    time.sleep(3)  # past env's last microseconds, well inside bitwise
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 124, out
    cut = _lines(out, "cut")
    assert len(cut) == 1 and "stopped by SIGINT" in cut[0] and "in bitwise" in cut[0], out
    assert _budget_row(out, "env")[0][-1] == "INFO" and _budget_row(out, "steps")[0][-2:] == ["not", "run"]
    assert _lines(out, "total")[0].endswith("FAIL")
