"""Offline planner: from a saved statistics snapshot, solve for a plan - no training needed.

    python scripts/solve_plan.py --stats runs/tiny/plans/step_000050_stats.json --fp4-target 0.75 --out plans_out
    python scripts/solve_plan.py --stats runs/tiny/plans/step_000050_stats.json --target gemm_time \\
        --time-budget 0.6 --gpu h100 --out plans_h100

The target is resolved as the trainer resolves ``snip.target`` (``PlanContext.for_run``):
``--target fp4_share`` (the default: at least ``--fp4-target`` of the linear FLOPs in an FP4 format),
``gemm_time`` (the plan's modeled linear-GEMM time at most ``--time-budget`` x the same GEMMs in
BF16) or ``both``. A time target needs the GEMM time costs of the GPU it plans for: the table of
``precision/capability.py`` for ``--backend`` on ``--gpu``, or ``--time-costs bf16=1,fp8=0.5``
(``snip.time_costs``, e.g. measured by ``scripts/gpu_check.sh``). As in training, candidates slower
than BF16 there (run emulated) are left out of the plan.

The costs are normalized over the candidates the plan may choose, as in training (the controller
measures only those). Writes into --out: ``plan.json`` (the PrecisionPlan), ``plan.png`` (precision
map: blocks x GEMMs coloured by format) and ``pareto.png`` / ``pareto.json``, the predicted
divergence of the optimal plan along the target:

* FP4-share target: the FP4 target from 0 to 1, ``[{"fp4_target", "objective"}, ...]``;
* time target: the GEMM-time budget from 0.05 to 1 (with ``both``, the FP4 floor held), each optimal
  plan's objective against its modeled GEMM-time ratio, ``[{"time_budget", "objective",
  "gemm_time_ratio"}, ...]`` (an infeasible budget: objective Infinity, ratio null).

Snapshots are the ``plans/step_*_stats.json`` files the SNIP controller writes next to each plan.

A run-level FP4 budget (``snip.budget = "run"``, ``snip/budget.py``): ``--run-dir RUN`` reads the run's
``config.toml`` (its target, share range and grid, LR schedule, re-plan steps) and the plans in force
before ``--step`` (default: the snapshot's) from ``RUN/plans/step_*.json``, and answers what share the
interval from that step gets - the budget's decision is printed and written to ``budget.json``, and
``plan.json`` is the plan at that share:

    python scripts/solve_plan.py --stats runs/x/plans/step_000150_stats.json --run-dir runs/x --out plans_150

Costs remembered across re-plans (``snip.cost_ema > 0``, ``snip/cost_memory.py``): with ``--run-dir`` the
snapshot's costs are averaged with the memory replayed from the run's earlier snapshots
(``RUN/plans/step_*_stats.json`` before the step: one per applied plan, each at its step's lambda), so
the plan is the one the run made. Kept forward formats (``snip.forward_stickiness > 0``): with
``--run-dir`` each forward GEMM's cost in the format the run's plan in force before the step gives it
is discounted, as the controller did, and with ``snip.forward_depth_prior > 0`` the forward GEMMs'
costs are weighted by depth (``snip/priors.py``); the printed objective and the Pareto curve keep the
measured costs. With ``--run-dir`` lambda is the run's (``snip.weight_divergence_weight``, LR-scaled
where the run scaled it) unless ``--weight-divergence-weight`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_snip.config import SNIP_TARGETS, Config, SnipConfig, load_config, parse_time_costs
from megatron_snip.precision.capability import BACKENDS, GPUS
from megatron_snip.precision.plan import GRANULARITIES, LINEARS, GemmId, PrecisionPlan
from megatron_snip.snip import budget as run_budget
from megatron_snip.snip import cost_memory, ilp, priors
from megatron_snip.snip.metrics import predicted_divergence
from megatron_snip.snip.policies import PlanContext, cost_curve, make_plan, policy_costs
from megatron_snip.telemetry.plots import plot_pareto, plot_precision_map

FP4_TARGETS = [round(0.05 * i, 2) for i in range(21)]  # the FP4-share Pareto sweep: 0, 0.05, ..., 1
TIME_BUDGETS = [round(0.05 * i, 2) for i in range(1, 21)]  # the GEMM-time Pareto sweep: 0.05, ..., 1
# The config fields this script's flags set: a config error naming the field is reported with the flag.
FLAGS = {"snip.fp4_target": "--fp4-target", "snip.time_budget": "--time-budget", "snip.time_costs": "--time-costs",
         "snip.formats": "--formats", "snip.weight_divergence_weight": "--weight-divergence-weight",
         "time_budget": "--time-budget", "fp4_target": "--fp4-target"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stats", required=True, help="a plans/step_*_stats.json snapshot")
    ap.add_argument("--target", default="fp4_share", choices=SNIP_TARGETS, help="efficiency target (snip.target)")
    ap.add_argument("--fp4-target", type=float, default=0.75, help="rho: minimum FP4 FLOP share (fp4_share, both)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="gemm_time, both: the plan's modeled GEMM time at most this fraction of BF16's, e.g. 0.6")
    ap.add_argument("--gpu", default=None, choices=sorted(GPUS), help="the GPU a time target plans for")
    ap.add_argument("--backend", default="te", choices=BACKENDS,
                    help="the backend whose GEMMs --gpu's time costs model (the run's precision.backend; default te)")
    ap.add_argument("--time-costs", default=None, metavar="FMT=RATIO,...",
                    help="relative GEMM time per FLOP instead of --gpu's table, e.g. bf16=1,fp8=0.5 (snip.time_costs)")
    ap.add_argument("--policy", default="snip", choices=["snip", "min_rel_err"])
    ap.add_argument("--formats", default=None, help="candidates, comma-separated (default: the snapshot's)")
    ap.add_argument("--granularity", default=SnipConfig.granularity, choices=GRANULARITIES,
                    help="decision unit (snip.granularity; default the config default)")
    ap.add_argument("--weight-divergence-weight", type=float, default=None,
                    help="lambda in sum(dL + lambda*dW) (default 1, or the run's with --run-dir)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages for the per-stage constraints")
    ap.add_argument("--run-dir", default=None,
                    help="a run with snip.budget=\"run\" (plan the interval from --step with its budget and plan "
                         "history), snip.cost_ema > 0 (average with the costs its earlier snapshots leave), "
                         "snip.forward_stickiness > 0 (discount the forward formats of the plan in force before "
                         "--step) or snip.forward_depth_prior > 0 (weigh the forward GEMMs' costs by depth)")
    ap.add_argument("--step", type=int, default=None, help="with --run-dir: the re-plan step (default: the snapshot's)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = Path(args.stats)
    if not path.is_file():
        print(f"error: --stats {str(path)!r} does not exist", file=sys.stderr)
        return 2
    snapshot = json.loads(path.read_text())
    try:
        return solve(args, path, snapshot)
    except ValueError as e:  # bad flags, an infeasible target, a snapshot that cannot give these costs
        print(f"error: {flag_message(e)}", file=sys.stderr)
        return 2


def solve(args: argparse.Namespace, path: Path, snapshot: Mapping[str, Any]) -> int:
    """Plan, precision map and Pareto sweep into ``args.out``; ValueError for bad input or targets."""
    if snapshot.get("kind") == "truth":
        raise ValueError(f"--stats {str(path)!r} holds the measured divergences of a run of policy truth, not "
                         f"SNIP statistics; this planner re-solves the snapshots of snip and min_rel_err runs "
                         f"(experiments/plan_regret.py scores plans with a truth snapshot)")
    formats = tuple(args.formats.split(",")) if args.formats else tuple(snapshot["formats"])
    linears = snapshot["linears"].values()
    num_layers = 1 + max(s["layer"] for s in linears)
    # FLOP weight K*N of each linear (shapes are per TP shard; every linear is sharded alike, so shares agree).
    numel = {s["linear"]: s["shape"][0] * s["shape"][1] for s in linears if s["layer"] == 0}
    assert set(numel) == set(LINEARS), f"snapshot lacks block 0's linears: {sorted(numel)}"

    ctx = plan_context(args, formats, num_layers, numel, step=int(snapshot["step"]))
    unmeasured = [f for f in ctx.candidates if f not in snapshot["formats"]]
    if unmeasured:
        left_out = "" if ctx.candidates == formats else f" (candidates under the time target: {list(ctx.candidates)})"
        raise ValueError(f"--formats {list(formats)}{left_out}: {unmeasured} were not measured in this snapshot, "
                         f"which holds {snapshot['formats']}; pass --formats from those")
    run_cfg = None if args.run_dir is None else run_config(Path(args.run_dir))
    step = int(snapshot["step"]) if args.step is None else args.step
    lam = args.weight_divergence_weight
    if lam is None:
        lam = 1.0 if run_cfg is None else run_budget.weight_divergence_weight_at(run_cfg, step)
    costs = policy_costs(args.policy, measured_only(snapshot, ctx.candidates), lam)
    out = Path(args.out)
    decision = None
    solved = costs  # what the ILP solves; the printed objective and the Pareto curve price the measured costs
    if run_cfg is not None:
        snip = run_cfg.snip
        if snip.budget != "run" and snip.cost_ema == 0 and snip.forward_stickiness == 0 and snip.forward_depth_prior == 0:
            raise ValueError(f"--run-dir {args.run_dir!r} ran with snip.budget=\"plan\", snip.cost_ema=0, "
                             f"snip.forward_stickiness=0 and snip.forward_depth_prior=0: nothing of the run changes "
                             f"this plan; drop --run-dir")
        if snip.cost_ema > 0:
            memory = replayed_memory(Path(args.run_dir), run_cfg, args.policy, ctx.candidates, step)
            costs = cost_memory.smoothed(costs, memory, snip.cost_ema)
        in_force = plans_before(Path(args.run_dir), step)[-1].as_dict() if snip.forward_stickiness > 0 else {}
        solved = priors.solver_costs(costs, snip, run_cfg.model.num_layers, in_force)
        if snip.budget == "run":
            decision, ctx = run_budget_share(args, run_cfg, ctx, solved, step)
    plan = make_plan(args.policy, ctx, solved)
    out.mkdir(parents=True, exist_ok=True)
    if decision is not None:
        plan = plan.with_extra(decision.extra())
        (out / "budget.json").write_text(json.dumps(decision.extra(), indent=1))
        print(f"run budget at step {step}: interval share "
              f"{float(decision.share):.4f} until step {decision.interval[1]} (run target {float(decision.run_target):g}, "
              f"spent {float(decision.spent):.4f}, unspent after it {float(decision.unspent):.4f}); schedule "
              f"{decision.extra()['budget_schedule']}" + (f" ({decision.clamped})" if decision.clamped else ""))
    (out / "plan.json").write_text(plan.to_json())
    what = f"rho={args.fp4_target}" if ctx.time_cost is None else f"GEMM time <= {ctx.time_budget} x BF16"
    plot_precision_map(plan, out / "plan.png", title=f"{args.policy} plan from {path.name}, {what}")
    problem = ilp.build_problem(costs, numel, ctx.candidates, ctx.fp4_target, ctx.granularity,
                                stage_of_layer=ctx.stage_of_layer, time_cost=ctx.time_cost, time_budget=ctx.time_budget)
    if ctx.time_cost is None:
        points = ilp.pareto_curve(problem, FP4_TARGETS)
        rows = [{"fp4_target": r, "objective": o} for r, o in points]
        plot_pareto(points, out / "pareto.png", title=f"{args.policy}: predicted divergence vs FP4 target")
    else:
        rows = time_pareto(problem, ctx)
        at = [(r["time_budget"] if r["gemm_time_ratio"] is None else r["gemm_time_ratio"], r["objective"]) for r in rows]
        plot_pareto(at, out / "pareto.png",
                    title=f"{args.policy}: predicted divergence vs modeled GEMM time",
                    xlabel="modeled GEMM time / BF16 (x: infeasible budget)")
    (out / "pareto.json").write_text(json.dumps(rows, indent=1))

    summary = f"plan: FP4 share {plan.fp4_flops_share:.3f}"
    if ctx.time_cost is not None:
        left_out = [f for f in formats if f not in ctx.candidates]
        print("time costs per FLOP vs BF16: " + ", ".join(f"{f} {t:g}" for f, t in ctx.time_cost.items())
              + (f"; left out (slower than BF16): {left_out}" if left_out else ""))
        summary += f", GEMM time {ctx.time_ratio(plan.as_dict()):.4f} of BF16 (budget {ctx.time_budget})"
    print(f"{summary}, formats {plan.format_counts()}, objective "
          f"{predicted_divergence(costs, plan.as_dict()):.4f} ({plan.solver_status}), hash {plan.hash}")
    print(f"wrote {out}/plan.json, plan.png, pareto.png, pareto.json")
    return 0


def plan_context(args: argparse.Namespace, formats: tuple[str, ...], num_layers: int, numel: Mapping[str, int],
                 step: int) -> PlanContext:
    """The flags as a run's ``snip`` section, resolved into a ``PlanContext`` as the trainer does."""
    timed = args.target != "fp4_share"
    if not timed and (args.time_budget is not None or args.gpu or args.time_costs):
        raise ValueError("--time-budget, --gpu and --time-costs set a GEMM-time target; "
                         "add --target gemm_time (or --target both)")
    if timed and args.time_budget is None:
        raise ValueError(f"--target {args.target} needs --time-budget: the plan's modeled GEMM time as a fraction "
                         f"of BF16's, e.g. --time-budget 0.6")
    if timed and not (args.gpu or args.time_costs):
        raise ValueError(f"--target {args.target} needs the GEMM time costs of the GPU it plans for: pass --gpu "
                         f"(one of {sorted(GPUS)}) with --backend, or --time-costs, e.g. bf16=1,fp8=0.5")
    time_costs = tuple(e.strip() for e in args.time_costs.split(",")) if args.time_costs else ()
    given = parse_time_costs(time_costs)  # ValueError naming snip.time_costs (reported as --time-costs)
    missing = [f for f in formats if f not in given]
    if given and missing:
        raise ValueError(f"--time-costs {args.time_costs!r} has no entry for the candidate(s) {missing}; "
                         f"add '<format>=<ratio>' for each")
    lam = 1.0 if args.weight_divergence_weight is None else args.weight_divergence_weight  # checked as the field
    settings = SnipConfig(policy=args.policy, formats=formats, fp4_target=args.fp4_target,
                          granularity=args.granularity, weight_divergence_weight=lam,
                          target=args.target, time_budget=1.0 if args.time_budget is None else args.time_budget,
                          time_costs=time_costs)
    return PlanContext.for_run(settings, num_layers, numel, args.pp, step=step, backend=args.backend,
                               sm=GPUS[args.gpu].sm if args.gpu else None)


def run_config(run: Path) -> Config:
    """The config of run directory ``run`` (its ``config.toml``; ValueError without one)."""
    if not (run / "config.toml").is_file():
        raise ValueError(f"--run-dir {str(run)!r} has no config.toml; give a training.run_dir")
    return load_config(str(run / "config.toml"))


def replayed_memory(run: Path, cfg: Config, policy: str, candidates: tuple[str, ...],
                    step: int) -> dict[GemmId, dict[str, float]] | None:
    """The cost memory (``snip.cost_ema``) the run held before re-planning at ``step``: the costs of its
    snapshots ``plans/step_*_stats.json`` of earlier steps, averaged in order as the controller did
    (a snapshot is written only for an applied plan, the memory's only updates); None without one."""
    snapshots = [json.loads(p.read_text()) for p in (run / "plans").glob("step_*_stats.json")]
    memory = None
    for snap in sorted((s for s in snapshots if s["step"] < step), key=lambda s: s["step"]):
        lam = run_budget.weight_divergence_weight_at(cfg, int(snap["step"]))
        memory = cost_memory.smoothed(policy_costs(policy, measured_only(snap, candidates), lam), memory,
                                      cfg.snip.cost_ema)
    return memory


def plans_before(run: Path, step: int) -> list[PrecisionPlan]:
    """The plans ``run/plans/step_*.json`` made before ``step``, in step order (the last is the plan in force
    when the run re-planned at ``step``); ValueError when there is none."""
    plans = sorted((PrecisionPlan.load(p) for p in (run / "plans").glob("step_*.json") if not p.stem.endswith("_stats")),
                   key=lambda p: p.step)
    history = [p for p in plans if p.step < step]
    if not history:
        raise ValueError(f"--run-dir {str(run)!r} has no plan before step {step} in plans/; --step must follow the "
                         f"initial plan (step_000000.json)")
    return history


def run_budget_share(args: argparse.Namespace, cfg: Config, ctx: PlanContext, costs: Mapping[Any, Mapping[str, float]],
                     step: int) -> tuple[run_budget.BudgetDecision, PlanContext]:
    """``--run-dir`` of a run with ``snip.budget = "run"`` (config ``cfg``): its budget decision at ``step``
    and the context at its share (ValueError without plans before the step)."""
    run = Path(args.run_dir)
    history = plans_before(run, step)
    rb = run_budget.RunBudget.for_run(cfg)
    if not rb.horizon[0] <= step < rb.horizon[1]:
        raise ValueError(f"--step {step} is outside the budget's horizon [{rb.horizon[0]}, {rb.horizon[1]}) "
                         f"(snip.warmup, training.max_steps of {str(run / 'config.toml')!r})")
    ctx = replace(ctx, run_target=cfg.snip.fp4_target, step=step)
    decision = rb.decide(step, history, ctx.linear_numel, cost_curve(args.policy, ctx, costs, rb.grid))
    return decision, ctx.with_share(float(decision.share))


def measured_only(snapshot: Mapping[str, Any], formats: tuple[str, ...]) -> dict[str, Any]:
    """``snapshot`` holding only ``formats``: SNIP's metrics normalize over the formats a snapshot
    holds (by the harshest), and training measures only the candidates a plan may choose."""
    linears = {k: {**s, "per_format": {f: s["per_format"][f] for f in formats}} for k, s in snapshot["linears"].items()}
    return {**snapshot, "formats": list(formats), "linears": linears}


def time_pareto(problem: ilp.Problem, ctx: PlanContext) -> list[dict[str, Any]]:
    """The optimal plan at each budget of ``TIME_BUDGETS``: its objective and modeled GEMM-time ratio."""
    rows = []
    for budget, sol in ilp.pareto_solutions(problem, TIME_BUDGETS, over="time_budget"):
        rows.append({"time_budget": budget, "objective": sol.objective if sol.ok else math.inf,
                     "gemm_time_ratio": ctx.time_ratio(sol.assignment) if sol.ok else None})
    return rows


def flag_message(e: Exception) -> str:
    """An error naming config fields (``config snip.time_budget=0: ...``, ``time_budget=0.4 cannot be
    met``) in this script's flags (``--time-budget 0: ...``)."""
    msg = str(e)
    for field, flag in FLAGS.items():
        msg = msg.replace(f"config {field}=", f"{flag} ").replace(f"{field}=", f"{flag} ")
    return msg


if __name__ == "__main__":
    sys.exit(main())
