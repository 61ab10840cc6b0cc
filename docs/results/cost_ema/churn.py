"""Per re-plan of two arms' SNIP runs: how many GEMMs each plan protects, how many it changes from the
arm's previous plan (the churn), how many protected GEMMs the two arms' plans share, and how much
worse each arm's costs rate the other arm's plan than its own (the regret).

    python docs/results/cost_ema/churn.py runs/ce4_plan runs/ce4_ema [--policy snip]

Reads only ``<out-dir>/<policy>_*_seed<N>/plans/step_*.json`` (the plans in force, the initial one
first). Protected: a GEMM not in an FP4 format. Changed: GEMMs whose format differs from the
previous plan's (for the first re-plan, from the BF16 initial plan: every GEMM). Regret a: the
other arm's plan priced by the costs of arm a's own snapshot at that step (``policies.policy_costs``,
lambda 1, as the runs used), over a's plan priced the same, minus 1; regret b likewise. A small
regret says the two plans are near-equivalent under SNIP's own model. An arm whose plans are
solved from other costs than its snapshot's (``snip.cost_ema``: the average) can have a negative
regret: the other plan is then the better one under this re-plan's costs alone. Ends with the mean churn per arm over the re-plans after the first.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from megatron_snip.precision.plan import GemmId
from megatron_snip.snip.metrics import predicted_divergence
from megatron_snip.snip.policies import policy_costs


def plans(run: Path) -> dict[int, dict[str, str]]:
    """step -> entries ({"<layer>.<linear>.<gemm>": format}) of every plan of ``run``."""
    out = {}
    for path in (run / "plans").glob("step_*.json"):
        if not path.stem.endswith("_stats"):
            plan = json.loads(path.read_text())
            out[plan["step"]] = plan["entries"]
    return dict(sorted(out.items()))


def runs(out_dir: Path, policy: str) -> dict[int, Path]:
    """seed -> the run directory of ``policy`` (one format set per out-dir)."""
    return {int(r.name.rsplit("_seed", 1)[1]): r for r in sorted(out_dir.glob(f"{policy}_*_seed*"))}


def regret(run: Path, step: int, own: dict[str, str], other: dict[str, str]) -> float:
    """How much worse ``run``'s costs at ``step`` rate ``other`` than ``own`` (a fraction)."""
    costs = policy_costs("snip", json.loads((run / "plans" / f"step_{step:06d}_stats.json").read_text()))

    def price(entries: dict[str, str]) -> float:
        return predicted_divergence(costs, {GemmId.parse(g): f for g, f in entries.items()})

    return price(other) / price(own) - 1.0


def protected(entries: dict[str, str]) -> set[str]:
    return {g for g, f in entries.items() if not f.startswith("fp4")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the first arm's out-dir")
    ap.add_argument("b", type=Path, help="the second arm's out-dir")
    ap.add_argument("--policy", default="snip")
    args = ap.parse_args()
    runs_a, runs_b = runs(args.a, args.policy), runs(args.b, args.policy)
    print("| seed | step | protected a | protected b | changed a | changed b | shared | regret a | regret b |")
    print("|---|---|---|---|---|---|---|---|---|")
    later = {"a": [], "b": []}
    for seed in sorted(set(runs_a) & set(runs_b)):
        pa, pb = plans(runs_a[seed]), plans(runs_b[seed])
        steps = [s for s in pa if s in pb]
        for prev, step in itertools.pairwise(steps):
            ca = sum(pa[step][g] != pa[prev][g] for g in pa[step])
            cb = sum(pb[step][g] != pb[prev][g] for g in pb[step])
            if prev != steps[0]:
                later["a"].append(ca)
                later["b"].append(cb)
            ra = regret(runs_a[seed], step, pa[step], pb[step])
            rb = regret(runs_b[seed], step, pb[step], pa[step])
            print(f"| {seed} | {step} | {len(protected(pa[step]))} | {len(protected(pb[step]))} | {ca} | {cb} "
                  f"| {len(protected(pa[step]) & protected(pb[step]))} | {ra:+.1%} | {rb:+.1%} |")
    for arm, changed in later.items():
        if changed:
            print(f"\nmean GEMMs changed per re-plan after the first, arm {arm}: "
                  f"{sum(changed) / len(changed):.2f} over {len(changed)} re-plans")


if __name__ == "__main__":
    main()
