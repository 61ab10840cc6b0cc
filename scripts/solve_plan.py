"""Offline planner: from a saved statistics snapshot, solve for a plan - no training needed.

    python scripts/solve_plan.py --stats runs/tiny/plans/step_000050_stats.json --fp4-target 0.75 --out plans_out

Writes into --out: ``plan.json`` (the PrecisionPlan), ``plan.png`` (precision map: blocks x
GEMMs coloured by format) and ``pareto.png`` / ``pareto.json`` (FP4 target from 0 to 1 vs the
predicted divergence of the optimal plan). Snapshots are the ``plans/step_*_stats.json`` files
the SNIP controller writes next to each plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_snip.config import SnipConfig
from megatron_snip.precision.plan import LINEARS
from megatron_snip.snip import ilp
from megatron_snip.snip.metrics import predicted_divergence
from megatron_snip.snip.policies import PlanContext, make_plan, policy_costs
from megatron_snip.telemetry.plots import plot_pareto, plot_precision_map


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stats", required=True, help="a plans/step_*_stats.json snapshot")
    ap.add_argument("--fp4-target", type=float, default=0.75)
    ap.add_argument("--policy", default="snip", choices=["snip", "min_rel_err"])
    ap.add_argument("--formats", default=None, help="candidates, comma-separated (default: the snapshot's)")
    ap.add_argument("--granularity", default="layer", choices=["layer", "gemm"])
    ap.add_argument("--weight-divergence-weight", type=float, default=1.0, help="lambda in sum(dL + lambda*dW)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages for the per-stage FP4 constraint")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    path = Path(args.stats)
    if not path.is_file():
        print(f"error: --stats {str(path)!r} does not exist", file=sys.stderr)
        return 2
    snapshot = json.loads(path.read_text())
    formats = tuple(args.formats.split(",")) if args.formats else tuple(snapshot["formats"])
    unknown = [f for f in formats if f not in snapshot["formats"]]
    if unknown:
        print(f"error: --formats {list(unknown)} were not measured in this snapshot ({snapshot['formats']})", file=sys.stderr)
        return 2
    try:
        costs = policy_costs(args.policy, snapshot, args.weight_divergence_weight)
    except ValueError as e:  # e.g. a min_rel_err snapshot (no noise passes) asked for a snip plan
        print(f"error: {e}", file=sys.stderr)
        return 2
    costs = {g: {f: c[f] for f in formats} for g, c in costs.items()}
    linears = snapshot["linears"].values()
    num_layers = 1 + max(s["layer"] for s in linears)
    # FLOP weight K*N of each linear (shapes are per TP shard; every linear is sharded alike, so shares agree).
    numel = {s["linear"]: s["shape"][0] * s["shape"][1] for s in linears if s["layer"] == 0}
    assert set(numel) == set(LINEARS), f"snapshot lacks block 0's linears: {sorted(numel)}"

    try:
        settings = SnipConfig(policy=args.policy, formats=formats, fp4_target=args.fp4_target,
                              granularity=args.granularity, weight_divergence_weight=args.weight_divergence_weight)
        ctx = PlanContext.for_run(settings, num_layers, numel, args.pp, step=int(snapshot["step"]))
        plan = make_plan(args.policy, ctx, costs)
    except (ilp.InfeasibleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(plan.to_json())
    plot_precision_map(plan, out / "plan.png", title=f"{args.policy} plan from {path.name}, rho={args.fp4_target}")

    problem = ilp.build_problem(costs, numel, formats, args.fp4_target, args.granularity,
                                stage_of_layer=ctx.stage_of_layer)
    targets = [round(0.05 * i, 2) for i in range(21)]
    points = ilp.pareto_curve(problem, targets)
    (out / "pareto.json").write_text(json.dumps([{"fp4_target": r, "objective": o} for r, o in points], indent=1))
    plot_pareto(points, out / "pareto.png", title=f"{args.policy}: predicted divergence vs FP4 target")

    print(f"plan: FP4 share {plan.fp4_flops_share:.3f}, formats {plan.format_counts()}, objective "
          f"{predicted_divergence(costs, plan.as_dict()):.4f} ({plan.solver_status}), hash {plan.hash}")
    print(f"wrote {out}/plan.json, plan.png, pareto.png, pareto.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
