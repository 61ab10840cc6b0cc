"""How the probe's size trades SNIP's re-plan cost against the quality of what it predicts.

    python -m experiments.exp_probe_size --run-dir runs/validate_metrics --out docs/bench/probe_size.json

On the metric-validation checkpoint (experiments/validate_metrics.py: `tiny` trained --steps in BF16,
resumed from --run-dir, trained there if absent) the ground truth is measured once on held-out
batches (``validate_metrics.ground_truth``). Then, for every probe setting PxSxD (P probe
micro-batches of S sequences, D forward-noise draws each: ``snip.probe_batches``,
``snip.probe_micro_batch_size``, ``snip.noise_draws``), statistics are collected on --windows
disjoint windows of training data, and reported per setting (mean, min and max over windows):

- ``spearman``: rank correlation of predicted ΔL and ΔW with the truth, per --formats and over
  all of them (what experiments/validate_metrics.py reports for one setting);
- ``plan_agreement``: share of GEMMs given the same format as the reference plan, for the
  SNIP plan over --plan-formats at --fp4-target; the reference plan comes from a --reference
  setting on its own window, after the others (so no setting shares its data);
- ``plan_regret``: how much worse the plan is than the reference plan under the reference
  setting's costs, (objective(plan) - objective(reference plan)) / objective(reference plan);
  ``baseline_regret`` gives the same for the ``min_rel_err`` and ``random`` policies' plans, as
  a scale;
- ``stats_s``: seconds of statistics (all formats, so more than a re-plan with fewer of them;
  the first window of a new micro-batch shape also compiles quantizer kernels, so read the
  median; ``python -m experiments.bench.overheads`` measures the re-plan itself).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from experiments import validate_metrics as vm
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.snip.controller import draw_micro_batches
from megatron_snip.snip.metrics import predicted_divergence
from megatron_snip.snip.policies import PlanContext, make_plan, policy_costs
from megatron_snip.snip.stats import ProbeConfig, StatsCollector


def parse_setting(text: str) -> tuple[int, int, int]:
    """"PxSxD" -> (probe micro-batches, sequences each, noise draws)."""
    try:
        p, s, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: probe setting {text!r} is not PxSxD, e.g. 2x8x2") from None
    if min(p, s, d) < 1:
        raise SystemExit(f"error: probe setting {text!r} needs P, S, D >= 1")
    return p, s, d


def summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vm.add_checkpoint_args(ap)
    ap.add_argument("--formats", default="nvfp4,mxfp4", help="formats scored against the ground truth")
    ap.add_argument("--plan-formats", default="fp8,nvfp4", help="candidates of the plans compared")
    ap.add_argument("--fp4-target", type=float, default=0.75)
    ap.add_argument("--truth-batches", type=int, default=4)
    ap.add_argument("--settings", default="4x8x2,2x8x2,1x8x1,2x4x1,1x4x1,2x2x1,1x2x1,1x1x1",
                    help="probe settings PxSxD, comma-separated")
    ap.add_argument("--reference", default="8x8x2", help="the setting of the reference plan")
    ap.add_argument("--windows", type=int, default=3, help="disjoint data windows per setting")
    ap.add_argument("--out", default="docs/bench/probe_size.json")
    args = ap.parse_args(argv)

    truth_formats = tuple(args.formats.split(","))
    plan_formats = tuple(args.plan_formats.split(","))
    formats = tuple(dict.fromkeys(truth_formats + plan_formats))
    settings = [parse_setting(s) for s in args.settings.split(",")]
    reference = parse_setting(args.reference)

    trainer = vm.trained_trainer(args.config, args.overrides, args.steps, args.run_dir)
    cfg, t = trainer.cfg, trainer.cfg.training
    t0 = time.perf_counter()
    truth = vm.ground_truth(trainer, truth_formats, args.truth_batches)
    truth_s = time.perf_counter() - t0
    print(f"ground truth: {len(truth)} rows in {truth_s:.0f}s", flush=True)

    # Window w starts at sequence first + w * stride; every setting fits inside one stride.
    first = args.steps * t.global_batch_size
    stride = max(p * s for p, s, _ in settings + [reference])
    ctx = PlanContext.for_run(cfg.snip, cfg.model.num_layers, linear_numel(model_linear_shapes(cfg.model)),
                              cfg.parallel.pp, formats=plan_formats, fp4_target=args.fp4_target, granularity="layer")

    def snapshot(setting: tuple[int, int, int], window: int) -> dict:
        p, s, d = setting
        collector = StatsCollector(ProbeConfig(formats=formats, noise_draws=d, seed=cfg.snip.seed,
                                               compiled_quantizers=cfg.precision.compile_quantizers))
        probe = draw_micro_batches(trainer.data.train, first + window * stride, p, s, trainer.device)
        return collector.collect(trainer, probe, trainer.step)

    def plan_of(snap: dict, policy: str = "snip") -> dict:
        costs = None if policy == "random" else policy_costs(policy, snap, cfg.snip.weight_divergence_weight)
        if costs is not None:
            costs = {g: {f: c[f] for f in plan_formats} for g, c in costs.items()}
        return make_plan(policy, ctx, costs).as_dict()

    reference_snapshot = snapshot(reference, args.windows)
    reference_costs = policy_costs("snip", reference_snapshot, cfg.snip.weight_divergence_weight)
    reference_plan = plan_of(reference_snapshot)
    best = predicted_divergence(reference_costs, reference_plan)

    def regret(plan: dict) -> float:
        return (predicted_divergence(reference_costs, plan) - best) / best

    baseline_regret = {p: regret(plan_of(reference_snapshot, p)) for p in ("min_rel_err", "random")}
    print(f"reference {args.reference}: objective {best:.4f}; regret of min_rel_err "
          f"{baseline_regret['min_rel_err']:.3f}, random {baseline_regret['random']:.3f}", flush=True)
    results = []
    for setting in settings:
        per_window = []
        for w in range(args.windows):
            snap = snapshot(setting, w)
            rows = vm.with_predictions(truth, snap)
            corr = vm.correlations(rows, truth_formats)
            plan = plan_of(snap)
            same = sum(plan[k] == reference_plan[k] for k in reference_plan) / len(reference_plan)
            per_window.append({"stats_s": sum(snap["timings"].values()), "plan_agreement": same,
                               "plan_regret": regret(plan),
                               "spearman": {f: {"dL": c["dL_pred~dL_true"], "dW": c["dW_pred~dW_true"]}
                                            for f, c in corr.items()}})
        row = {"setting": "x".join(map(str, setting)), "probe_batches": setting[0], "probe_micro_batch_size": setting[1],
               "noise_draws": setting[2], "sequences": setting[0] * setting[1],
               "stats_s": summary([r["stats_s"] for r in per_window]),
               "plan_agreement": summary([r["plan_agreement"] for r in per_window]),
               "plan_regret": summary([r["plan_regret"] for r in per_window]),
               "spearman": {f: {m: summary([r["spearman"][f][m] for r in per_window]) for m in ("dL", "dW")}
                            for f in per_window[0]["spearman"]},
               "windows": per_window}
        results.append(row)
        sp = row["spearman"]["all"]
        print(f"{row['setting']:>7}: stats {row['stats_s']['median']:5.1f}s  dL rho {sp['dL']['mean']:.2f} "
              f"[{sp['dL']['min']:.2f}, {sp['dL']['max']:.2f}]  dW rho {sp['dW']['mean']:.2f} "
              f"[{sp['dW']['min']:.2f}, {sp['dW']['max']:.2f}]  plan agreement {row['plan_agreement']['mean']:.2f}, "
              f"regret {row['plan_regret']['mean']:.3f} [{row['plan_regret']['min']:.3f}, {row['plan_regret']['max']:.3f}]",
              flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": shlex.join(["python", "-m", "experiments.exp_probe_size", *(sys.argv[1:] if argv is None else argv)]),
        "steps": args.steps, "formats": list(truth_formats), "plan_formats": list(plan_formats),
        "fp4_target": args.fp4_target, "truth_batches": args.truth_batches, "windows": args.windows,
        "reference": args.reference, "reference_objective": best, "baseline_regret": baseline_regret,
        "truth_s": truth_s, "results": results}, indent=1))
    print(f"wrote {out}")
    trainer.logger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
