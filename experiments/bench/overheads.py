"""What SNIP and the emulated formats cost on the machine it runs on; writes a JSON (docs/overheads.json).

    python -m experiments.bench.overheads --formats fp8,mxfp8,mxfp4,nvfp4 --reps 5       # docs/overheads.json
    python -m experiments.bench.overheads --set training.global_batch_size=80 --skip-emulation --skip-ilp \
        --out docs/bench/overheads_tiny_gbs80.json                                      # re-plan only
    python -m experiments.bench.overheads --set snip.probe_batches=P --set snip.probe_micro_batch_size=S \
        --set snip.noise_draws=1 --skip-emulation --skip-ilp --reps 5 --out docs/bench/overheads_probe_PxSx1.json

(a) Re-plan cost: one ``Trainer`` (``--config``, default tiny) and its ``SnipController``; after
    a few training steps, each repetition times one training step and one
    ``SnipController.replan`` (statistics + metrics + solve + apply) side by side in this
    process, then puts the model back in BF16. Medians over ``--reps`` (after one untimed
    re-plan, which pays one-off costs such as compiling quantizer kernels). Reported as a
    multiple of one training step (in BF16, and in the plan the re-plan made) and, at the
    configured ``snip.interval``, as a share of training time:
    replan / (interval x planned step + replan).
(b) Emulation overhead: one training step with every GEMM in format f (uniform plan) against
    one all-BF16 step on the same trainer - ``experiments.bench.step``'s measurement (rotating
    rounds of BF16 + every format, median of the per-round ratios), ``--reps`` rounds. A
    format that cannot run (e.g. not implemented) is recorded with its error.
(c) CP-SAT solve time vs problem size: the 70B-shaped instances of ``experiments.bench.ilp``
    (``solve_instance``), 8 to 80 layers, both granularities.

Timings are wall-clock on a possibly shared machine: medians, with the min next to them. One
torch thread by default (``--threads``): that is how experiments/compare_policies.py runs its jobs,
and a single thread is far less disturbed by other processes than two threads on two cores.

The quantizers run as ``--config`` says (``tiny.toml``: compiled); ``--compiled-quantizers`` /
``--no-compiled-quantizers`` override ``precision.compile_quantizers`` for training and SNIP
statistics (same numerics either way). The JSON records which. Like the training entry point,
the process fixes glibc's malloc thresholds (``gemm.tune_cpu_malloc``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from experiments.bench import ilp as bench_ilp
from experiments.bench.common import build_trainer, machine, uniform_plan
from experiments.bench.step import Stepper, measure_steps
from megatron_snip.config import load_config
from megatron_snip.precision.gemm import tune_cpu_malloc

EMULATED = ("fp8", "nvfp4", "mxfp4")


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure_replan(trainer, reps: int, warm_steps: int) -> dict[str, Any]:
    """(a): medians of one BF16 step, one re-plan and one step in the re-planned precision."""
    from megatron_snip.snip.controller import SnipController

    ctrl = SnipController(trainer.cfg, trainer)
    bf16 = uniform_plan(trainer, "bf16")
    step = 0
    for _ in range(warm_steps):  # optimizer state exists (the statistics precondition by AdamW's v)
        trainer.train_step(step)
        step += 1
    ctrl.replan(trainer, step)  # untimed: first-use costs (kernel compilation, allocator warm-up)
    trainer.apply_plan(bf16)
    step_bf16, step_plan, replan, parts = [], [], [], []
    step_plan_error = None
    for _ in range(reps):
        step_bf16.append(_timed(trainer.train_step, step))
        step += 1
        t0 = time.perf_counter()
        parts.append(dict(ctrl.replan(trainer, step).timings))
        replan.append(time.perf_counter() - t0)
        try:
            step_plan.append(_timed(trainer.train_step, step))  # in the plan the re-plan just made
        except NotImplementedError as e:
            step_plan_error = f"{type(e).__name__}: {e}"
        step += 1
        trainer.apply_plan(bf16)
    interval = trainer.cfg.snip.interval
    med = statistics.median
    planned = med(step_plan) if step_plan else None
    step_ref = planned if planned is not None else med(step_bf16)
    out = {
        "policy": trainer.cfg.snip.policy, "formats": list(trainer.cfg.snip.formats),
        "fp4_target": trainer.cfg.snip.fp4_target, "interval": interval, "probe_batches": trainer.cfg.snip.probe_batches,
        "replan_s": med(replan), "replan_min_s": min(replan),
        "stats_s": med([p.get("stats_s", 0.0) for p in parts]),
        "metrics_s": med([p.get("metrics_s", 0.0) for p in parts]),
        "solve_s": med([p.get("solve_s", 0.0) for p in parts]),
        "apply_s": med([p.get("apply_s", 0.0) for p in parts]),
        "stats_parts_s": {k: med([p[k] for p in parts]) for k in parts[0] if k.startswith("stats_") and k != "stats_s"},
        "step_s": med(step_bf16), "step_min_s": min(step_bf16), "planned_step_s": planned,
        "replan_over_step": med(replan) / med(step_bf16),
        "replan_over_planned_step": None if planned is None else med(replan) / planned,
        "pct_of_training_at_interval": 100.0 * med(replan) / (interval * step_ref + med(replan)),
        "reps": reps,
    }
    if not step_plan:
        out["planned_step_error"] = step_plan_error
    return out


def measure_emulation(trainer, formats: tuple[str, ...], reps: int) -> dict[str, Any]:
    """(b): per format, a step with every GEMM in it vs a BF16 step - ``bench.step.measure_steps``
    (rotating rounds, median of per-round ratios), so both benchmarks report the same measurement.
    A format the backend cannot run on this model is reported with its error and skipped."""
    stepper = Stepper(trainer)
    out: dict[str, Any] = {"formats": {}}
    runnable = []
    for fmt in formats:
        try:
            uniform_plan(trainer, fmt).validate(trainer.all_gemm_ids)
            stepper(fmt)  # untimed: compilation / first use
            runnable.append(fmt)
        except (NotImplementedError, ValueError) as e:
            out["formats"][fmt] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    stepper("bf16")  # untimed, as each format's first step
    res = measure_steps(stepper, runnable, warmup=0, rounds=reps)
    for fmt in runnable:
        v = res[fmt]
        out["formats"][fmt] = {"step_s": v["wall_s"], "step_min_s": v["wall_min_s"], "bf16_step_s": res["bf16"]["wall_s"],
                               "ratio": v["ratio_wall"], "reps": reps}
    out["bf16_step_s"] = res["bf16"]["wall_s"]
    trainer.apply_plan(uniform_plan(trainer, "bf16"))
    return out


def measure_ilp(layers: tuple[int, ...], repeats: int, max_time: float) -> dict[str, Any]:
    """(c): CP-SAT on ``bench.ilp``'s 70B-shaped instances (random costs, rho 0.75, 8 stages)."""
    rows = []
    for granularity in ("gemm", "layer"):
        for num_layers in layers:
            r = bench_ilp.solve_instance(num_layers, granularity, "random", repeats=repeats, max_time=max_time)
            units, status = len(r["problem"].units), r["solutions"][-1].status
            rows.append({"granularity": granularity, "layers": num_layers, "units": units, "stages": r["stages"],
                         "status": status, "solve_s": r["solve_s"], "e2e_s": r["e2e_s"]})
            print(f"  ilp {granularity:>5} {num_layers:>3} layers {units:>4} units: {status} "
                  f"solve {r['solve_s']:.3f}s (build+solve {r['e2e_s']:.3f}s)", flush=True)
    return {"formats": list(bench_ilp.FORMATS), "rho": 0.75, "costs": "random", "rows": rows, "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="launch/configs/tiny.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (medians)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (torch.set_num_threads)")
    ap.add_argument("--warm-steps", type=int, default=2, help="training steps before the first re-plan")
    ap.add_argument("--formats", default=",".join(EMULATED), help="formats for (b), comma-separated")
    ap.add_argument("--ilp-layers", default="8,16,32,80")
    ap.add_argument("--ilp-repeats", type=int, default=1)
    ap.add_argument("--compiled-quantizers", action=argparse.BooleanOptionalAction, default=None,
                    help="force precision.compile_quantizers on (or off with --no-compiled-quantizers); "
                         "default: what --config says")
    ap.add_argument("--skip-replan", action="store_true")
    ap.add_argument("--skip-emulation", action="store_true")
    ap.add_argument("--skip-ilp", action="store_true")
    ap.add_argument("--out", default="docs/overheads.json")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        print(f"error: --reps={args.reps} and --threads={args.threads} must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    tune_cpu_malloc()  # as the training entry point does for the emulated backend
    run_dir = tempfile.mkdtemp(prefix="bench_overheads_")
    try:
        compiled = ([] if args.compiled_quantizers is None
                    else [f"precision.compile_quantizers={str(args.compiled_quantizers).lower()}"])
        cfg = load_config(args.config, [*args.overrides, *compiled, "snip.enabled=true", "precision.initial_plan=bf16",
                                        "training.progress=false", f"training.run_dir={json.dumps(run_dir)}"])
        formats = tuple(f for f in args.formats.split(",") if f)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = cfg.training
    result: dict[str, Any] = {
        "compiled_quantizers": cfg.precision.compile_quantizers,
        "command": shlex.join(["python", "-m", "experiments.bench.overheads", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(),
        "model": {"config": args.config, "overrides": args.overrides, "num_layers": cfg.model.num_layers,
                  "hidden_size": cfg.model.hidden_size, "micro_batch_size": t.micro_batch_size,
                  "global_batch_size": t.global_batch_size, "seq_len": t.seq_len},
    }
    t0 = time.perf_counter()
    if not (args.skip_replan and args.skip_emulation):
        trainer = build_trainer(cfg)
        result["model"]["params_m"] = trainer.grads.global_numel() / 1e6
        name = f"{Path(args.config).stem}" + (f" ({' '.join(args.overrides)})" if args.overrides else "")
        if not args.skip_replan:
            print("(a) re-plan vs training step ...", flush=True)
            try:
                result["replan"] = {"model": name, **measure_replan(trainer, args.reps, args.warm_steps)}
                r = result["replan"]
                print(f"  re-plan {r['replan_s']:.2f}s (stats {r['stats_s']:.2f}, metrics {r['metrics_s']:.3f}, "
                      f"solve {r['solve_s']:.3f}) = {r['replan_over_step']:.1f} BF16 steps of {r['step_s']:.3f}s; "
                      f"{r['pct_of_training_at_interval']:.1f}% of training at interval {r['interval']}", flush=True)
            except NotImplementedError as e:
                result["replan"] = {"model": name, "error": f"NotImplementedError: {e}"}
                print(f"  skipped: {result['replan']['error']}", flush=True)
                trainer.apply_plan(uniform_plan(trainer, "bf16"))
        if not args.skip_emulation:
            print("(b) emulated formats vs BF16 ...", flush=True)
            result["emulation"] = {"model": name, **measure_emulation(trainer, formats, args.reps)}
            for f, v in result["emulation"]["formats"].items():
                print(f"  {f}: " + (v["error"] if "error" in v else
                                     f"{v['step_s']:.3f}s vs BF16 {v['bf16_step_s']:.3f}s = x{v['ratio']:.2f}"), flush=True)
        trainer.logger.close()
    if not args.skip_ilp:
        print("(c) CP-SAT solve time, 70B-shaped instances ...", flush=True)
        result["ilp"] = measure_ilp(tuple(int(x) for x in args.ilp_layers.split(",")), args.ilp_repeats, 10.0)
    result["bench_wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({result['bench_wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
