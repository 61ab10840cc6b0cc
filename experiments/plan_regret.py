"""How far a plan is from the truth-optimal one, in the measured objective (#25 item 3, the metric).

    python -m experiments.plan_regret --truth runs/ablation/truth/truth_..._seed11 \\
        --plan snip=runs/ablation/truth/snip_..._seed11 [--step 20] [--random 200]

At a re-plan step where every run had the same weights — the first one, when the runs continue
the same base on the same data in BF16 until then — the ``truth`` run's snapshot holds the measured
divergences of every linear (``snip/truth.py``). This scores plans with them
(``snip.metrics.truth_costs``, the objective the truth-optimal plan minimizes):

- the truth run's own plan: the optimum (its recorded objective, checked);
- each ``--plan`` run's plan at that step (e.g. SNIP's), and how many linears' formats differ;
- ``--random`` plans of the ``random`` policy at the same target (seeds 0..N-1): the mean of a
  plan chosen without any metric, the scale the others are read on.

"closed" is (random mean − plan) / (random mean − optimum): 1 = the optimum, 0 = no better than
chance. Costs are the runs' normalized units (a sum over 3 GEMMs per linear). Prints a markdown
table; nothing is trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from experiments.cli import emit_page, named_path
from megatron_snip.config import load_config
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.metrics import predicted_divergence
from megatron_snip.snip.policies import PlanContext, make_plan, policy_costs


def plan_at(run_dir: Path, step: int) -> PrecisionPlan:
    path = run_dir / "plans" / f"step_{step:06d}.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: is {run_dir} a run directory with a re-plan at step {step}?")
    return PrecisionPlan.from_json_dict(json.loads(path.read_text()))


def regret_table(truth_dir: Path, plans: dict[str, Path], step: int, randoms: int) -> str:
    cfg = load_config(str(truth_dir / "config.toml"))
    if cfg.snip.policy != "truth":
        raise ValueError(f"--truth={str(truth_dir)!r} ran policy {cfg.snip.policy!r}; it must be a run of policy truth")
    snapshot = json.loads((truth_dir / "plans" / f"step_{step:06d}_stats.json").read_text())
    costs = policy_costs("truth", snapshot, cfg.snip.weight_divergence_weight)
    optimum = plan_at(truth_dir, step)
    best = predicted_divergence(costs, optimum.as_dict())
    if optimum.objective is None or abs(best - optimum.objective) > 1e-6 * max(1.0, abs(best)):
        raise ValueError(f"the truth run's plan at step {step} has objective {optimum.objective}, but its snapshot's "
                         f"costs give it {best}: the snapshot and plan do not belong together, or the costs are "
                         f"computed differently than when the run was made")
    ctx = PlanContext.for_run(cfg.snip, cfg.model.num_layers, linear_numel(model_linear_shapes(cfg.model)),
                              cfg.parallel.pp, step=step)
    chance = [predicted_divergence(costs, make_plan("random", dataclasses.replace(ctx, seed=s)).as_dict())
              for s in range(randoms)]
    best_formats = optimum.as_dict()
    mean = statistics.fmean(chance) if chance else float("nan")

    def row(name: str, plan: PrecisionPlan) -> str:
        value = predicted_divergence(costs, plan.as_dict())
        differ = len({(g.layer, g.linear) for g, f in plan.as_dict().items() if best_formats[g] != f})
        closed = (mean - value) / (mean - best) if chance and mean != best else float("nan")
        return (f"| {name} | {plan.fp4_flops_share:.3f} | {value:.4f} | {value - best:+.4f} | {closed:.2f} | "
                f"{differ} |")

    lines = [(f"Plans at step {step} scored with the measured divergences of `{truth_dir}` "
              f"({snapshot['num_batches']} batches):"), "",
             "| plan | FP4 share | measured objective | regret | closed | linears in another format than the optimum |",
             "|---|---|---|---|---|---|", row("truth-optimal", optimum)]
    lines += [row(name, plan_at(d, step)) for name, d in plans.items()]
    if chance:
        lines.append(f"| random (mean of {randoms}) | | {mean:.4f} | {mean - best:+.4f} | 0.00 | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--truth", required=True, help="run directory of a truth-policy run")
    ap.add_argument("--plan", action="append", default=[], metavar="NAME=RUN_DIR", help="a run whose plan to score")
    ap.add_argument("--step", type=int, default=20, help="the re-plan step (the first: all runs had the same weights)")
    ap.add_argument("--random", type=int, default=200, help="random plans at the same target, for scale")
    args = ap.parse_args(argv)

    def make() -> str:
        plans = dict(named_path("--plan", text, "snip=runs/ablation/truth/snip_..._seed11") for text in args.plan)
        return regret_table(Path(args.truth), plans, args.step, args.random)

    return emit_page(make, None)


if __name__ == "__main__":
    sys.exit(main())
