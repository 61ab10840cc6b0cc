"""The training step with the stochastic-rounding draws apart (``compiled.draws_apart``, shipped) vs fused.

    python -m experiments.bench.sr_draws_step --rounds 8

At the policy comparison's model (``experiments.comparison.protocol.DEFAULT_SETS``: 8 blocks,
d=128, one micro-batch of 8 x 128 tokens, compiled quantizers, one thread), one trainer times a
BF16 step and a uniform ``--format`` step with each variant, alternating within every round (the
variants keep their own compiled-graph caches); medians over the rounds after two warm-up rounds.
``python -m experiments.bench.quantizers --sr-draws`` times the operands themselves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from experiments.bench.common import build_trainer, machine, uniform_plan
from experiments.comparison.protocol import DEFAULT_SETS
from megatron_snip.config import load_config
from megatron_snip.precision import gemm as gemm_module
from megatron_snip.precision.quantize import compiled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="fp4_block")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gemm_module.tune_cpu_malloc()
    print(f"# python -m experiments.bench.sr_draws_step {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# machine: {machine()}")
    cfg = load_config("launch/configs/tiny.toml", ["snip.enabled=false", "training.progress=false",
                      "training.max_steps=100000", f"training.run_dir={tempfile.mkdtemp()}/r", *DEFAULT_SETS])
    trainer = build_trainer(cfg)
    shipped = compiled.draws_apart
    variants = {"apart": (shipped, {}), "fused": (lambda *_: False, {})}
    times: dict[tuple[str, str], list[float]] = {(f, v): [] for f in ("bf16", args.format) for v in variants}
    step = 0
    try:
        for r in range(2 + args.rounds):
            for fmt in ("bf16", args.format):
                trainer.apply_plan(uniform_plan(trainer, fmt))
                for v, (rule, cache) in variants.items():
                    compiled.draws_apart, compiled._COMPILED = rule, cache
                    t0 = time.perf_counter()
                    trainer.train_step(step)
                    step += 1
                    if r >= 2:
                        times[(fmt, v)].append(time.perf_counter() - t0)
    finally:
        compiled.draws_apart, compiled._COMPILED = shipped, variants["apart"][1]
    m = {k: statistics.median(v) for k, v in times.items()}
    print("median step s: " + ", ".join(f"{f} {v} {s:.3f}" for (f, v), s in m.items()))
    print(f"{args.format} step / BF16 step: draws apart {m[(args.format, 'apart')] / m[('bf16', 'apart')]:.2f}, "
          f"fused {m[(args.format, 'fused')] / m[('bf16', 'fused')]:.2f}; "
          f"fused / apart ({args.format} step) {m[(args.format, 'fused')] / m[(args.format, 'apart')]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
