"""Per re-plan of two arms' SNIP runs: the probe's spike figures and how many protected GEMMs they share.

    python docs/results/preconditioner/replans.py runs/pc4_plan runs/pc4_probe [--policy snip]

For each seed and re-plan step of ``<out-dir>/<policy>_*_seed<N>/plans``: ``total_sq_update`` (‖u‖²,
the AdamW-preconditioned probe update over every parameter), the probe gradient's norm
(√``probe_sq_grad``), the GEMMs each arm's plan keeps out of FP4 (protected), and how many of them the
two plans share. Reads only the run directories' JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _runs(out_dir: Path, policy: str) -> dict[int, Path]:
    """seed -> the run directory of ``policy`` (one format set per out-dir)."""
    found = {}
    for run in sorted(out_dir.glob(f"{policy}_*_seed*")):
        found[int(run.name.rsplit("_seed", 1)[1])] = run
    return found


def _replans(run: Path) -> dict[int, tuple[float, float | None, set[str]]]:
    """step -> (total_sq_update, probe gradient norm or None, protected GEMMs) of each re-plan."""
    out = {}
    for stats_path in sorted((run / "plans").glob("step_*_stats.json")):
        stats = json.loads(stats_path.read_text())
        plan = json.loads((run / "plans" / stats_path.name.replace("_stats", "")).read_text())
        protected = {g for g, f in plan["entries"].items() if not f.startswith("fp4")}
        sq = stats.get("probe_sq_grad")
        out[stats["step"]] = (stats["total_sq_update"], None if sq is None else math.sqrt(sq), protected)
    return out


def _fmt(norm: float | None) -> str:
    return "-" if norm is None else f"{norm:.3g}"  # None: a snapshot from before probe_sq_grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the first arm's out-dir")
    ap.add_argument("b", type=Path, help="the second arm's out-dir")
    ap.add_argument("--policy", default="snip")
    args = ap.parse_args()
    runs_a, runs_b = _runs(args.a, args.policy), _runs(args.b, args.policy)
    print("| seed | step | ‖u‖² a | ‖u‖² b | probe ‖g‖ a | probe ‖g‖ b | protected a | protected b | shared |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seed in sorted(set(runs_a) & set(runs_b)):
        ra, rb = _replans(runs_a[seed]), _replans(runs_b[seed])
        for step in sorted(set(ra) & set(rb)):
            (ua, ga, pa), (ub, gb, pb) = ra[step], rb[step]
            print(f"| {seed} | {step} | {ua:.3g} | {ub:.3g} | {_fmt(ga)} | {_fmt(gb)} | {len(pa)} | {len(pb)} "
                  f"| {len(pa & pb)} |")


if __name__ == "__main__":
    main()
