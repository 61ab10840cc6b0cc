"""The offline carry list (scripts/offline_wheels.toml) is exactly what the trainer and gpu_check need.

A child process where only the standard library, the list's ``[image]`` modules (a CUDA PyTorch
image) and its ``[carry]`` wheels' modules can be imported - every other top-level module is
absent, as on the offline machine: each import finder is wrapped to find nothing for it, so
``import x`` raises ModuleNotFoundError and ``importlib.util.find_spec`` returns None - imports the
trainer, the Triton kernels and probes, and runs gpu_check's ``env`` and ``tiny_snip`` checks
(Trainer, SNIP's solver, the plan plots, the progress bars) in --smoke. It must pass, and every
carried wheel must have been imported (no dead entry). The old list (no tqdm, no matplotlib, no
pandas) fails here: tqdm is imported by the trainer's logger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / "scripts/offline_wheels.toml"

CHILD = r'''
import json, sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb"))
allowed = set(sys.stdlib_module_names) | set(cfg["image"]["modules"]) | {m for ms in cfg["carry"].values() for m in ms}
allowed |= {"megatron_snip", "snip_kernels", "gpu_check", "gpu_check_report", "gpu_check_runs", "gpu_check_probes",
            "gpu_time_ratios"}
imported, blocked = set(), set()


class Absent:
    """Finds nothing for a module outside ``allowed`` (as if not installed); else asks the wrapped finder."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in allowed and not top.startswith("_sysconfigdata"):  # the interpreter's own build data
            blocked.add(top)
            return None
        imported.add(top)
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [Absent(f) for f in sys.meta_path]
import megatron_snip.train  # noqa: E402,F401
import snip_kernels.quantize, snip_kernels.probes  # noqa: E402,F401  (the device's kernels; Triton is in the image)
sys.path.insert(0, "scripts")
import gpu_check, gpu_time_ratios  # noqa: E402,F401
sys.argv = ["gpu_check.py", "--smoke", "--only", "env,tiny_snip"]
rc = gpu_check.main()
print("CARRY_RESULT " + json.dumps({"rc": rc, "imported": sorted(imported), "blocked": sorted(blocked)}))
'''


def test_the_trainer_and_gpu_check_run_with_only_the_image_and_the_carried_wheels():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(CARRY)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    result = [ln for ln in run.stdout.splitlines() if ln.startswith("CARRY_RESULT ")]
    assert result, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(result[0].removeprefix("CARRY_RESULT "))
    assert got["rc"] == 0, run.stdout[-3000:] + run.stderr[-3000:]
    carry = tomllib.loads(CARRY.read_text())["carry"]
    unused = sorted(dist for dist, modules in carry.items() if not set(modules) & set(got["imported"]))
    assert unused == [], f"carried but never imported: {unused}"
    assert "tqdm" in carry and "ortools" in carry
