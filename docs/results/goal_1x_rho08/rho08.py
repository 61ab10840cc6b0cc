"""protocol.md: ``../goal_1x/``'s design at the issue's ρ = 0.8. Shipped ``snip`` (plan budget), NVIDIA's
``tail+switch`` and ``snip+switch`` (run budget) at ρ = 0.8 on the reported seeds' 1.66M bases 1-4 ×
continuation data orders 0-3, against goal_1x's BF16 and uniform ``fp4_block`` runs of the same bases and
orders (references that do not depend on ρ; the check reruns two of each here).

    python docs/results/goal_1x_rho08/rho08.py > docs/results/goal_1x_rho08/table.md

Reads ``results_g8c.jsonl`` (the check), ``results_g8_o<k>_plan.jsonl`` (``snip``),
``results_g8_o<k>_run.jsonl`` (``tail+switch``, ``snip+switch``), goal_1x's ``results_g1_o<k>_plan.jsonl``
(BF16, uniform) and ``plans/o<k>_<run>_step_<N>.json`` (every plan of every run at ρ = 0.8: the
modelled GEMM time). The claims' tables are goal_1x.py's (imported: the same contrasts, rules and
recovered share), the modelled time full_switch/fw.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
for folder in ("replicas", "goal_replicas", "goal_1x", "full_switch"):
    sys.path.insert(0, str(RESULTS / folder))
import goal_1x  # the design, its tables and its references
from fw import modelled_time, run_plans

REFERENCES = ("bf16", "uniform:fp4_block")  # goal_1x's runs: no ρ in them


def records_path(arm: str, order: int) -> Path:
    """Where ``arm``'s records at ``order`` are: the ρ-free references goal_1x's, the others this study's."""
    return goal_1x.records_path(arm, order) if arm in REFERENCES else HERE / f"results_g8_o{order}_{goal_1x.ARMS[arm]}.jsonl"


def load() -> goal_1x.Runs:
    """goal_1x's arms at ρ = 0.8 (references from goal_1x), orders every arm finished on every base."""
    return goal_1x.whole_orders({arm: goal_1x.arm_runs(arm, lambda k, arm=arm: records_path(arm, k)) for arm in goal_1x.ARMS})


def spent() -> None:
    """Per arm at ρ = 0.8: the FP4 share over the continuation and of the last plan, and the modelled
    linear-GEMM time at B200's ratios, over every finished run."""
    print("## What the runs spent (from their records and recorded plans)\n")
    print("| arm | runs | FP4 share over the continuation | last plan's FP4 share | modelled GEMM time / BF16 (B200) |")
    print("|---|---|---|---|---|")
    for arm in goal_1x.ARMS:
        if arm in REFERENCES:
            continue
        recs = [(k, r) for k in goal_1x.ORDERS if (p := records_path(arm, k)).is_file()
                for r in map(json.loads, p.read_text().splitlines()) if r["policy"] == arm and r["status"] == "ok"]
        if not recs:
            continue
        times = [modelled_time(run_plans(f"o{k}", r, HERE / "plans"), r) for k, r in recs]
        print(f"| `{arm}` | {len(recs)} | " + ", ".join(sorted({f"{r['fp4_share_mean']:.4f}" for _, r in recs}))
              + " | " + ", ".join(sorted({f"{r['fp4_share']:.4f}" for _, r in recs})) + f" | {min(times):.4f}-{max(times):.4f} |")
    print()


def main() -> None:
    for arm in REFERENCES:
        goal_1x.check_against_records(f"`{arm}` at this study's flags", HERE / "results_g8c.jsonl", arm)
    spent()
    goal_1x.tables(load())


if __name__ == "__main__":
    main()
