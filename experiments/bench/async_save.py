"""Issue #36 items 4-5: the step time with and without ``training.async_save``, and what the profiler
labels cost when no profiler runs.

    OMP_NUM_THREADS=1 nice -n 10 python -m experiments.bench.async_save > docs/bench/async_save.txt

(a) Three contestants on ``--config`` (default tiny: 3.3M parameters, a 40 MB shard), each a short
    run of ``--steps`` steps through ``Trainer.fit``: ``none`` (no checkpoint before the final
    one), ``sync`` (a checkpoint every ``--save-interval`` steps, written in the loop) and ``async``
    (the same checkpoints with ``training.async_save=true``). Rounds rotate the three, so all see
    the same machine load. A step's time runs from one step's end (after its save, if any) to the
    next's: a synchronous save is in its step, an asynchronous one only its snapshot and whatever
    the writer thread takes from the training thread. The first step (warm-up) and the last (the
    final save, synchronous for all) are left out. Reported per contestant: the median step time,
    the median of save steps and of other steps, and the ratios async/sync and async/none of the
    medians over all steps (each round's own ratio, then their median).
(b) ``precision/profile_labels.label`` when no profiler records, per region, against an empty
    call and against ``torch.profiler.record_function`` (what a label always on would cost), and per
    step of ``--config`` with a uniform NVFP4 plan (9 regions per linear and micro-batch).

Wall clock on a shared machine: the load average is printed; the ratios from the same rounds are
the result, the seconds are not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

from experiments.bench.common import build_trainer, machine
from megatron_snip.config import load_config

CONTESTANTS = ("none", "sync", "async")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class _Clock:
    """Callback: the wall time and the training thread's CPU time at each step's end (after its save)."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float]] = []

    def before_step(self, host, step):
        if not self.ends:
            self.ends.append((time.perf_counter(), time.thread_time()))

    def after_step(self, host, step):
        self.ends.append((time.perf_counter(), time.thread_time()))


def _run(config: str, overrides: list[str], run_dir: Path) -> tuple[list[tuple[float, float]], list[float]]:
    """One run's step times, (wall, training-thread CPU) with step i+1's at index i, and its background
    writes' durations (from the log)."""
    cfg = load_config(config, overrides + [f"training.run_dir={run_dir}"])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the run's own log lines stay out of the table
        trainer = build_trainer(cfg)
        clock = _Clock()
        trainer.fit([clock])
        trainer.logger.close()
    writes = [float(m) for m in re.findall(r"committed \(async: written in ([0-9.]+) s", log.getvalue())]
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(clock.ends, clock.ends[1:])], writes


def _label_cost(config: str, overrides: list[str]) -> list[str]:
    from torch.autograd.profiler import record_function

    from megatron_snip.precision.profile_labels import label

    def off():
        with label("quantize", "nvfp4", "weight"):
            pass

    def empty():
        pass

    def always():
        with record_function("quantize:nvfp4:weight"):
            pass

    n = 200_000
    t_off, t_empty = (min(timeit.repeat(f, number=n, repeat=5)) / n for f in (off, empty))
    t_rf = min(timeit.repeat(always, number=n // 10, repeat=5)) / (n // 10)
    cfg = load_config(config, overrides)
    t = cfg.training
    regions = 9 * 4 * cfg.model.num_layers * (t.global_batch_size // t.micro_batch_size)
    return [(f"(b) label() without a profiler: {t_off * 1e9:.0f} ns per region (an empty call: {t_empty * 1e9:.0f} ns; "
            f"record_function without a profiler: {t_rf * 1e9:.0f} ns)"),
            (f"    {regions} regions per step of {config} with a uniform quantized plan (9 per linear and micro-batch): "
            f"{regions * (t_off - t_empty) * 1e6:.0f} us per step added, {regions * t_rf * 1e6:.0f} us with "
            f"record_function always on")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="launch/configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-interval", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    common = [f"training.max_steps={args.steps}", "training.eval_interval=100000", "training.log_interval=100000",
              "training.progress=false", "snip.enabled=false", "data.valid_paths=[]", "training.keep_checkpoints=2"]
    per = {"none": ["training.save_interval=0"],
           "sync": [f"training.save_interval={args.save_interval}"],
           "async": [f"training.save_interval={args.save_interval}", "training.async_save=true"]}
    print(f"# python -m experiments.bench.async_save {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# machine: {machine()}")
    print(f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, niceness {os.nice(0)}")
    t0 = time.perf_counter()
    times = {c: [] for c in CONTESTANTS}  # per round: the step times of steps 2..steps-1
    writes: list[float] = []  # the async runs' background writes (s)
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for r in range(args.rounds):
            order = CONTESTANTS[r % 3:] + CONTESTANTS[:r % 3]  # rotate who goes first
            for c in order:
                steps, w = _run(args.config, common + per[c], Path(tmp) / f"{c}_{r}")
                writes += w
                times[c].append(steps[1:-1])  # leave out step 1 (warm-up) and the last (final save)
    saves = {i for i in range(2, args.steps) if i % args.save_interval == 0}  # 1-based steps that checkpoint (mid-run)
    print(f"(a) {args.config}: {args.steps} steps, checkpoint every {args.save_interval} (steps {sorted(saves)} "
          f"mid-run), {args.rounds} rounds; medians over rounds and steps 2..{args.steps - 1}, in s")
    for kind, col in (("wall time", 0), (("training thread's CPU time (time.thread_time: not slowed by other "
                                         "processes, blind to fsync waits and GIL waits)"), 1)):
        print(f"  {kind}")
        print(f"    {'contestant':<10}{'all steps':>12}{'save steps':>12}{'other steps':>13}")
        for c in CONTESTANTS:
            rounds = [[st[col] for st in rt] for rt in times[c]]
            flat = [v for rt in rounds for v in rt]
            save = [v for rt in rounds for i, v in enumerate(rt, start=2) if i in saves and c != "none"]
            other = [v for rt in rounds for i, v in enumerate(rt, start=2) if i not in saves or c == "none"]
            print(f"    {c:<10}{_median(flat):12.4f}{_median(save):12.4f}{_median(other):13.4f}")
        for a, b in (("async", "sync"), ("async", "none"), ("sync", "none")):
            per_round = [_median([st[col] for st in x]) / _median([st[col] for st in y])
                         for x, y in zip(times[a], times[b])]
            print(f"    step time {a}/{b}: {_median(per_round):.3f} (per round: "
                  + ", ".join(f"{v:.3f}" for v in per_round) + ")")
    print(f"    async: {len(writes)} background writes, median {statistics.median(writes):.3f} s from snapshot to "
          f"written (training ran meanwhile)")
    for line in _label_cost(args.config, common):
        print(line)
    print(f"# wall {time.perf_counter() - t0:.0f} s, load average at the end {list(os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
