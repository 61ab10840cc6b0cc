"""How noisy is SNIP's forward-noise curvature κ, and which estimator buys the most per pass?

    python -m experiments.exp_curvature_estimator [--draws 32] [--train-steps 60] [--sigma-scale 1]
                                                  [--out docs/bench/curvature_estimator.json]

Trains `tiny` (BF16, --train-steps), takes one probe micro-batch, and records for ``--draws``
Gaussian draws ε (σ as in stats.py: the harshest format's forward-error scale, noise in every
linear's Y at once) the three gradients G(+ε), G(-ε) and the reference G(0) of every linear.
Per draw it keeps the two per-linear Hutchinson numerators

    antithetic: <ε, G(+ε) - G(-ε)> / 2   (2 noisy passes)
    one-sided:  <ε, G(+ε) - G(0)>         (1 noisy pass; G(0) comes free with the reference pass)

and the denominator ‖ε‖². An estimator with a given number of noisy passes is scored against a
held-out "truth": the antithetic estimate over all *other* draws (leave-subset-out, so no
estimator shares samples with its truth). Reported per estimator: relative RMS error of the 16
per-linear κ (RMS over linears of (κ̂ - κ_truth) / mean|κ_truth|, averaged over disjoint subsets)
and the Spearman correlation of κ̂ with the truth across linears.

``--sigma-scale`` multiplies σ (the noise-scale question: κ depends on σ only through the
third- and higher-order terms of the loss in Y; compare ``kappa_truth_all_draws`` across scales).
The short BF16 training run goes to a temporary directory (``--run-dir`` keeps it).

It re-runs the statistics' forward-noise pass one draw at a time through the public
``StatsCollector.noisy_output_grads`` (the pass ``snip/stats.py`` itself runs) and its noise scale
``forward_noise_sigma`` of the ``harshest_format``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from experiments.bench.common import build_trainer
from megatron_snip.config import load_config
from megatron_snip.precision.gemm import tune_cpu_malloc
from megatron_snip.snip.stats import ProbeConfig, StatsCollector, forward_noise_sigma, harshest_format, key_of

ESTIMATORS = (("antithetic", 1), ("antithetic", 2), ("one-sided", 1), ("one-sided", 2), ("one-sided", 4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="launch/configs/tiny.toml")
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--sigma-scale", type=float, default=1.0, help="multiplies the noise σ of stats.py")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/bench/curvature_estimator.json")
    ap.add_argument("--run-dir", default=None, help="run directory of the training steps (default: a temporary one)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    tune_cpu_malloc()
    with tempfile.TemporaryDirectory(prefix="exp_curvature_") as tmp:
        run_dir = args.run_dir or str(Path(tmp) / "run")
        cfg = load_config(args.config, [f"training.run_dir={json.dumps(run_dir)}", "snip.enabled=false"])
        trainer = build_trainer(cfg)
        out = estimate(args, cfg, trainer)
        trainer.logger.close()
    out = {"command": shlex.join(["python", "-m", "experiments.exp_curvature_estimator",
                                  *(sys.argv[1:] if argv is None else argv)]), **out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def estimate(args: argparse.Namespace, cfg, tr) -> dict:
    """Train ``tr`` for --train-steps, draw the noise, score the estimators against the held-out truth."""
    for step in range(args.train_steps):
        tr.train_step(step)
    collector = StatsCollector(ProbeConfig(formats=tuple(cfg.snip.formats),
                                           compiled_quantizers=cfg.precision.compile_quantizers))
    tokens = tr.micro_batches(10_000)[0]
    sums = collector.collect(tr, [tokens], 10_000, noise_passes=False)["linears"]
    linears = list(tr.model.precision_linears())
    keys = [key_of(lin) for lin in linears]
    harshest = harshest_format(collector.cfg.formats, sums)
    sigma = {k: args.sigma_scale * forward_noise_sigma(sums[k], harshest) for k in keys}
    gen = torch.Generator().manual_seed(7)

    def grads(noise):
        # G only: `tiny` runs fp32 on the CPU, where the realized perturbation is ε to fp32 rounding.
        return collector.noisy_output_grads(tr, tokens, noise)[0]

    t0 = time.perf_counter()
    g0 = grads(None)
    num = {"antithetic": [], "one-sided": []}
    den = []
    for _ in range(args.draws):
        eps = {k: torch.randn(g0[k].shape, generator=gen) * sigma[k] for k in keys}
        g_plus, g_minus = grads(eps), grads({k: -v for k, v in eps.items()})
        num["antithetic"].append(np.array([float((eps[k] * (g_plus[k] - g_minus[k])).sum()) / 2 for k in keys]))
        num["one-sided"].append(np.array([float((eps[k] * (g_plus[k] - g0[k])).sum()) for k in keys]))
        den.append(np.array([float(eps[k].pow(2).sum()) for k in keys]))
    num = {k: np.stack(v) for k, v in num.items()}
    den = np.stack(den)

    results = []
    for kind, draws_per_estimate in ESTIMATORS:
        errs, rhos = [], []
        for start in range(0, args.draws - draws_per_estimate + 1, draws_per_estimate):
            used = np.zeros(args.draws, bool)
            used[start:start + draws_per_estimate] = True
            truth = num["antithetic"][~used].sum(0) / den[~used].sum(0)
            est = num[kind][used].sum(0) / den[used].sum(0)
            errs.append(float(np.sqrt(np.mean(((est - truth) / np.abs(truth).mean()) ** 2))))
            rhos.append(float(spearmanr(est, truth).statistic))
        passes = draws_per_estimate * (2 if kind == "antithetic" else 1)
        results.append({"estimator": kind, "draws": draws_per_estimate, "noisy_passes": passes,
                        "rel_rms_err": float(np.mean(errs)), "spearman_vs_truth": float(np.mean(rhos)),
                        "subsets": len(errs)})
        print(f"{kind:>10} x{draws_per_estimate} ({passes} noisy passes): relative RMS error {np.mean(errs):.2f}, "
              f"Spearman vs truth {np.mean(rhos):.2f} over {len(errs)} subsets", flush=True)
    # The truth's own noise: the spread of single-draw antithetic estimates / sqrt(draws).
    single = num["antithetic"] / den
    truth_all = num["antithetic"].sum(0) / den.sum(0)
    truth_rel_se = float(np.sqrt(np.mean((single.std(0) / math.sqrt(args.draws) / np.abs(truth_all).mean()) ** 2)))
    print(f"truth's own relative standard error (all {args.draws} draws): {truth_rel_se:.2f}; "
          f"{time.perf_counter() - t0:.0f} s of noise passes")
    return {"config": args.config, "train_steps": args.train_steps, "draws": args.draws, "threads": args.threads,
            "sigma_scale": args.sigma_scale,
            "linears": keys, "kappa_truth_all_draws": truth_all.tolist(), "truth_rel_se": truth_rel_se,
            "estimators": results}


if __name__ == "__main__":
    sys.exit(main())
