"""Issue #3 benchmark: an emulated low-precision training step vs a BF16 step.

    python -m experiments.bench.step > docs/bench/bench_quant.txt            # compiled, 1 thread
    python -m experiments.bench.step --eager --formats nvfp4,mxfp4,fp8 --steps 3 > docs/bench/bench_quant_eager.txt
    python -m experiments.bench.step --formats nvfp4 --profile > docs/bench/bench_quant_profile.txt

(1) Step ratios. One ``Trainer`` on ``--config`` (default ``tiny``: 4 layers, d=256, micro-batch
    8 x 256 tokens, fp32, SNIP off). Every GEMM of every linear runs in one format (a uniform
    plan, switched with ``trainer.apply_plan`` between steps). First each format runs
    ``--warmup`` untimed steps (they pay kernel compilation and allocator warm-up; their times
    are reported separately as "warm-up"). Then ``--steps`` rounds: each round times one step of
    BF16 and one of every format, in a rotating order, so that all formats see the same machine
    load. Reported per format: the median step time (wall clock and process CPU time) and the
    median over rounds of (format step / BF16 step of the same round) - the issue's ratio.
(2) ``--profile``: for the last format, the share of one step spent inside ``quantize`` (wall
    clock around every call of ``gemm.quantize``), then torch.profiler self time by group (GEMMs,
    quantizer kernels, Python/autograd, ...) next to a BF16 step, and the top ops.
(3) Quantizer throughput per format and operand kind on the six operands of one linear
    (``--linear T,K,N``, default tiny's fc1: 2048 tokens, 256 -> 1536), laid out as in training,
    in the same mode (compiled or eager): ``experiments.bench.quantizers.print_throughput``
    (``python -m experiments.bench.quantizers`` compares eager with compiled on any linear).

By default the process first calls ``gemm.tune_cpu_malloc()`` (fixed glibc mmap/trim
thresholds, which the training entry point sets too; see its docstring); ``--no-malloc-tuning``
measures an untuned process. ``python -m experiments.bench.overheads`` records part (1) in JSON.

Timings are on a possibly shared machine. One torch thread by default: on few cores shared with
other processes, two OpenMP threads stall at every barrier whenever a core is taken (a step
then varies 2-10x), which swamps what is being measured. CPU time of a one-thread process is
the least disturbed measure; wall time is printed next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from experiments.bench.common import build_trainer, uniform_plan
from experiments.bench.quantizers import parse_linear, print_throughput
from megatron_snip.config import load_config
from megatron_snip.precision import gemm as gemm_module
from megatron_snip.precision.formats import get_format

FORMATS = ("fp8", "mxfp8", "mxfp4", "nvfp4")


class Stepper:
    """Runs training steps in a chosen uniform plan; consecutive data positions."""

    def __init__(self, trainer) -> None:
        self.trainer, self.step, self.skipped = trainer, 0, 0
        self.plans = {}

    def __call__(self, fmt: str) -> tuple[float, float]:
        """One training step in ``fmt``: (wall, process CPU) seconds."""
        if fmt not in self.plans:
            self.plans[fmt] = uniform_plan(self.trainer, fmt)
        self.trainer.apply_plan(self.plans[fmt])
        w0, c0 = time.perf_counter(), time.process_time()
        result = self.trainer.train_step(self.step)
        times = time.perf_counter() - w0, time.process_time() - c0
        self.skipped += int(result.skipped)
        self.step += 1
        return times


def measure_steps(stepper: Stepper, formats: list[str], warmup: int, rounds: int) -> dict:
    """(1): warm-up per format, then ``rounds`` rotating rounds of BF16 + every format."""
    names = ["bf16", *formats]
    warm = {f: [stepper(f)[0] for _ in range(warmup)] for f in names}
    wall: dict[str, list[float]] = {f: [] for f in names}
    cpu: dict[str, list[float]] = {f: [] for f in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for f in order:
            w, c = stepper(f)
            wall[f].append(w)
            cpu[f].append(c)
    med = statistics.median
    out = {}
    for f in names:
        out[f] = {
            "wall_s": med(wall[f]), "wall_min_s": min(wall[f]), "cpu_s": med(cpu[f]),
            "ratio_wall": med([a / b for a, b in zip(wall[f], wall["bf16"])]),
            "ratio_cpu": med([a / b for a, b in zip(cpu[f], cpu["bf16"])]),
            "warmup_s": warm[f], "warmup_extra_s": sum(warm[f]) - len(warm[f]) * med(wall[f]),
        }
    return out


def print_steps(res: dict, threads: int, mode: str) -> None:
    print(f"\n(1) one training step, every GEMM in one format vs BF16 ({mode} quantizers, {threads} thread(s); "
          "medians over rounds; ratio = median of per-round ratios)")
    print(f"{'format':8s} {'wall s':>8s} {'(min)':>7s} {'cpu s':>7s} {'ratio wall':>11s} {'ratio cpu':>10s} "
          f"{'warm-up steps (s)':>20s} {'of which extra s':>16s}")
    for f, v in res.items():
        warm = " ".join(f"{t:.1f}" for t in v["warmup_s"])
        print(f"{f:8s} {v['wall_s']:8.3f} {v['wall_min_s']:7.3f} {v['cpu_s']:7.3f} {v['ratio_wall']:10.2f}x "
              f"{v['ratio_cpu']:9.2f}x {warm:>20s} {v['warmup_extra_s']:16.1f}")


def profile_step(stepper: Stepper, fmt: str, steps: int, top: int) -> None:
    """(2): time inside quantize() and the top profiler ops of ``steps`` steps in ``fmt``."""
    real_quantize = gemm_module.quantize
    spent = [0.0, 0]

    def timed_quantize(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_quantize(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    gemm_module.quantize = timed_quantize
    try:
        walls = []
        for _ in range(steps):
            walls.append(stepper(fmt)[0])
    finally:
        gemm_module.quantize = real_quantize
    step_s = sum(walls) / steps
    q_s = spent[0] / steps
    print(f"\n(2) profile of a {fmt} step: {step_s:.3f}s wall, of which {q_s:.3f}s ({100 * q_s / step_s:.0f}%) "
          f"inside quantize() ({spent[1] // steps} calls per step, {1e6 * spent[0] / max(spent[1], 1):.0f} us per call)")
    groups_bf16, _ = _profile_groups(stepper, "bf16", steps)
    groups, rows = _profile_groups(stepper, fmt, steps)
    print(f"  torch.profiler self CPU time, s/step:  {'bf16':>8s} {fmt:>8s} {'diff':>8s}")
    for g in sorted(groups.keys() | groups_bf16.keys(), key=lambda k: -groups.get(k, 0.0)):
        a, b = groups_bf16.get(g, 0.0), groups.get(g, 0.0)
        print(f"    {g:34s} {a:8.3f} {b:8.3f} {b - a:+8.3f}")
    a, b = sum(groups_bf16.values()), sum(groups.values())
    print(f"    {'total (profiler on)':34s} {a:8.3f} {b:8.3f} {b - a:+8.3f}")
    print(f"  top {top} ops of the {fmt} step by self CPU time:")
    for e in rows[:top]:
        print(f"    {e.key[:60]:60s} {e.self_cpu_time_total / steps / 1e3:9.1f} ms/step  {e.count // steps:6d} calls/step")


_GROUPS = (  # (group, predicate on the profiler event name), first match wins
    ("GEMMs (aten::mm)", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm")),
    ("compiled quantizer graphs", lambda n: "CompiledFxGraph" in n or "Compiled Region" in n),
    ("dynamo guards / cache lookup", lambda n: "Dynamo" in n),
    ("attention", lambda n: "scaled_dot_product" in n),
    ("quant_linear autograd (Python)", lambda n: "QuantLinearFn" in n),
    ("elementwise ops", lambda n: n.split("::")[-1].rstrip("_") in _ELEMENTWISE),
)
_ELEMENTWISE = {"mul", "add", "sub", "div", "where", "abs", "amax", "clamp", "copysign", "round", "floor", "ge", "lt",
                "gt", "le", "eq", "ne", "bitwise_and", "bitwise_xor", "bitwise_or", "__rshift__", "__lshift__",
                "reciprocal", "copy", "fill", "to", "_to_copy", "isfinite", "isnan", "stack", "cat", "full_like",
                "arange", "randint", "maximum", "minimum", "neg", "mean", "sum", "pow", "rsqrt", "sqrt", "exp",
                "silu", "silu_backward", "addcdiv", "addcmul", "lerp", "sign", "mul_"}


def _profile_groups(stepper: Stepper, fmt: str, steps: int):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            stepper(fmt)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    groups: dict[str, float] = {}
    for e in rows:
        g = next((name for name, pred in _GROUPS if pred(e.key)), "other ops")
        groups[g] = groups.get(g, 0.0) + e.self_cpu_time_total / steps / 1e6
    return groups, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="launch/configs/tiny.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats to compare with bf16")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (one step per format each)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per format (reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, see above)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compiled", dest="compiled", action="store_true", default=True,
                      help="torch.compile'd quantizers (default)")
    mode.add_argument("--eager", dest="compiled", action="store_false", help="eager quantizers")
    ap.add_argument("--profile", action="store_true", help="(2): profile steps in the last format")
    ap.add_argument("--no-malloc-tuning", dest="malloc_tuning", action="store_false",
                    help="leave glibc malloc's thresholds alone (default: gemm.tune_cpu_malloc(), see there)")
    ap.add_argument("--linear", default="2048,256,1536",
                    help="T,K,N of the linear whose operands (3) times (default: tiny's fc1); 'none' skips (3)")
    ap.add_argument("--quant-reps", type=int, default=5, help="timed calls per operand in (3)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.threads < 1 or args.warmup < 1:
        print(f"error: --steps={args.steps}, --warmup={args.warmup} and --threads={args.threads} must be >= 1",
              file=sys.stderr)
        return 2
    formats = [f for f in args.formats.split(",") if f and f != "bf16"]
    try:
        for f in formats:
            get_format(f)
        linear = None if args.linear == "none" else parse_linear(args.linear)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    tuned = gemm_module.tune_cpu_malloc() if args.malloc_tuning else False
    mode_name = "compiled" if args.compiled else "eager"
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}, {mode_name} quantizers, "
          f"malloc thresholds {'tuned' if tuned else 'default'}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_quant_") as run_dir:
        try:
            cfg = load_config(args.config, [
                *args.overrides, "snip.enabled=false", "precision.initial_plan=bf16",
                f"precision.compile_quantizers={str(args.compiled).lower()}", "training.progress=false",
                f"training.run_dir={json.dumps(run_dir)}", "training.eval_interval=1000000"])
            trainer = build_trainer(cfg)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        stepper = Stepper(trainer)
        res = measure_steps(stepper, formats, args.warmup, args.steps)
        print_steps(res, args.threads, mode_name)
        if stepper.skipped:
            print(f"  ({stepper.skipped} steps were skipped by the NaN guard; their times lack the optimizer step)")
        if args.profile and formats:
            profile_step(stepper, formats[-1], 2, 15)
        trainer.logger.close()
    if linear is not None and formats:
        print_throughput(formats, *linear, args.quant_reps, args.compiled)
    print(f"\nbench wall time {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
