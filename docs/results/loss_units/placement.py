"""Where each arm's SNIP plans put their protected (non-FP4) GEMMs: counts by block and GEMM kind,
summed over every seed's re-plans (the plans in force after each re-plan, not the initial BF16 one).

    python docs/results/loss_units/placement.py "shipped=runs/pc4_plan" "loss=runs/lu4_loss" [--policy snip]

Reads only ``<out-dir>/<policy>_*_seed<N>/plans/step_*.json``; an out-dir may hold other seeds than
another's, so the seeds counted are printed with each arm.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from megatron_snip.precision.plan import GEMMS, GemmId


def replan_entries(run: Path) -> list[dict[str, str]]:
    """The entries of every plan ``run`` made at a re-plan (the initial plan, step 0, left out)."""
    out = []
    for path in sorted((run / "plans").glob("step_*.json")):
        if not path.stem.endswith("_stats"):
            plan = json.loads(path.read_text())
            if plan["step"] > 0:
                out.append(plan["entries"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arms", nargs="+", help="NAME=OUT_DIR")
    ap.add_argument("--policy", default="snip")
    args = ap.parse_args()
    for arm in args.arms:
        name, out_dir = arm.split("=", 1)
        runs = sorted(Path(out_dir).glob(f"{args.policy}_*_seed*"))
        counts: Counter[tuple[int, str]] = Counter()
        plans = 0
        for run in runs:
            for entries in replan_entries(run):
                plans += 1
                for g, f in entries.items():
                    if not f.startswith("fp4"):
                        gid = GemmId.parse(g)
                        counts[(gid.layer, gid.gemm)] += 1
        layers = range(1 + max((layer for layer, _ in counts), default=-1))
        seeds = ",".join(r.name.rsplit("_seed", 1)[1] for r in runs)
        print(f"\n**{name}** (`{out_dir}`, seeds {seeds}, {plans} plans): protected GEMMs by block\n")
        print("| GEMM | " + " | ".join(f"block {b}" for b in layers) + " | total |")
        print("|---|" + "---|" * (len(layers) + 1))
        for kind in GEMMS:
            row = [counts[(b, kind)] for b in layers]
            print(f"| {kind} | " + " | ".join(str(c) for c in row) + f" | {sum(row)} |")


if __name__ == "__main__":
    main()
