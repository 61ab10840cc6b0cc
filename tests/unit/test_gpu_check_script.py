"""scripts/gpu_check.py cannot pass on fallbacks: its own --smoke mode (CPU, toy sizes, the torch
backend with CPU's reference scaled-mm) reports a forced scaled-mm fallback as FAIL lines with the
reason and exits non-zero, and passes the same checks without it.

Only the scaled-mm checks run here (``--only``); the whole smoke run takes minutes on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _smoke(*extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--only", "scaled_mm,gemms", *extra],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _lines(out: str, name: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(f"{name} ")]


def test_smoke_passes_the_scaled_mm_checks_on_cpu():
    run = _smoke()
    assert run.returncode == 0, run.stdout + run.stderr
    fp8 = [ln for ln in _lines(run.stdout, "scaled_mm") if ln.split()[1] == "fp8:"]
    assert len(fp8) == 1 and "axw=real gxw=real gxa=real" in fp8[0] and fp8[0].endswith("OK")
    gemm = _lines(run.stdout, "gemm_fp8")
    assert len(gemm) == 1 and "exercised: scaled-mm for fprop, dgrad, wgrad" in gemm[0] and gemm[0].endswith("OK")
    block = _lines(run.stdout, "gemm_fp8_block")  # CPU torch refuses block scales: not expected there
    assert len(block) == 1 and "emulated fallback" in block[0] and "not expected here" in block[0]
    compiles = _lines(run.stdout, "compiles")  # the Triton / torch.compile count and each check's seconds
    assert len(compiles) == 1 and "Triton kernel specializations" in compiles[0] and "gemms" in compiles[0]


def test_smoke_fails_on_a_forced_fallback():
    run = _smoke("--force-fallback")
    assert run.returncode == 1, run.stdout + run.stderr
    fp8 = [ln for ln in _lines(run.stdout, "scaled_mm") if ln.split()[1] == "fp8:"]
    assert len(fp8) == 1 and fp8[0].endswith("FAIL") and "refused on purpose" in fp8[0], fp8
    gemm = _lines(run.stdout, "gemm_fp8")
    assert len(gemm) == 1 and gemm[0].endswith("FAIL") and "emulated fallback" in gemm[0], gemm
    total = _lines(run.stdout, "total")
    assert total and total[0].endswith("FAIL") and "scaled_mm" in total[0] and "gemm_fp8" in total[0]


def test_smoke_runs_the_sync_free_check():
    """``check_sync_free`` on CPU: the steady-state steps' only host reads are the foreach AdamW's
    skip flag (one per step), and no pageable host-to-device copy is counted."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    run = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--only", "sync_free"], check=False,
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    (sync,) = _lines(run.stdout, "sync_free")
    assert "3 steady-state steps: 3 host syncs {'read': 3} (allowed 3)" in sync and sync.endswith("OK")
