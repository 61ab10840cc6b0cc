"""Check SNIP's predicted divergences against measured ground truth (docs/snip.md, "How we check it").

    python -m experiments.validate_metrics --steps 300 --out docs/results/validation

1. Trains `tiny` in BF16 for --steps (or resumes the run in --run-dir if it has a checkpoint).
2. Collects SNIP statistics on probe batches of training data, as the controller does.
3. Ground truth (``megatron_snip/snip/truth.py``) on *held-out* batches, for every linear ℓ and
   format f, paired against BF16:
   - ΔL_true: loss with only ℓ's fprop in f minus the BF16 loss, averaged over batches;
   - ΔW_true: relative deviation ‖u_f − u‖/‖u‖ of the one-step AdamW update (current optimizer
     state, no step taken) when only ℓ's backward GEMMs (dgrad+wgrad) run in f; also each
     backward GEMM alone.
4. Prints Spearman rank correlations per format and writes results.json, a scatter plot and a
   markdown summary into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megatron_snip.config import load_config
from megatron_snip.snip import truth
from megatron_snip.snip.controller import draw_micro_batches
from megatron_snip.snip.metrics import curvature, linear_divergences, propagation_gain
from megatron_snip.snip.stats import ProbeConfig, StatsCollector, key_of
from megatron_snip.training.trainer import Trainer


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = x.argsort(kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # average ties
            idx = np.where(x == v)[0]
            r[idx] = r[idx].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--formats", default="fp8,nvfp4,mxfp4")
    ap.add_argument("--probe-batches", type=int, default=4)
    ap.add_argument("--probe-micro-batch-size", type=int, default=0,
                    help="sequences per probe micro-batch (snip.probe_micro_batch_size; 0 = training micro-batch)")
    ap.add_argument("--noise-draws", type=int, default=2)
    ap.add_argument("--truth-batches", type=int, default=8, help="held-out batches for the ground truth")
    ap.add_argument("--out", default="docs/results/validation")
    args = ap.parse_args(argv)

    formats = tuple(args.formats.split(","))
    trainer = trained_trainer(args.config, args.overrides, args.steps, args.run_dir)
    t = trainer.cfg.training

    # Predictions, exactly as the controller computes them.
    t0 = time.perf_counter()
    collector = StatsCollector(ProbeConfig(formats=formats, noise_draws=args.noise_draws, seed=trainer.cfg.snip.seed,
                                           compiled_quantizers=trainer.cfg.precision.compile_quantizers))
    probe = draw_micro_batches(trainer.data.train, args.steps * t.global_batch_size, args.probe_batches,
                               args.probe_micro_batch_size or t.micro_batch_size, trainer.device)
    snapshot = collector.collect(trainer, probe, trainer.step)
    stats_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    truth = ground_truth(trainer, formats, args.truth_batches)
    truth_s = time.perf_counter() - t0
    rows = with_predictions(truth, snapshot)
    corr = correlations(rows, formats)
    reliability = truth_reliability(rows, formats) if args.truth_batches >= 2 else None

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "experiments.validate_metrics", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command, "steps": args.steps,
              "probe_batches": args.probe_batches, "probe_micro_batch_size": args.probe_micro_batch_size,
              "noise_draws": args.noise_draws, "truth_batches": args.truth_batches,
              "stats_seconds": stats_s, "truth_seconds": truth_s, "spearman": corr,
              "truth_reliability": reliability, "rows": rows,
              "stats_timings": snapshot["timings"]}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plot(rows, formats, out / "scatter.png")
    lines = ["| format | " + " | ".join(f"{p} vs {q}" for p, q in PAIRS) + " |", "|---" * (len(PAIRS) + 1) + "|"]
    for f, c in corr.items():
        lines.append(f"| {f} | " + " | ".join(f"{c[f'{p}~{q}']:.2f}" for p, q in PAIRS) + " |")
    if reliability is not None:
        lines += ["", "Reliability of the ground truth (Spearman between its means over even and odd held-out batches;",
                  "stepped up to all batches by Spearman-Brown):", "",
                  "| format | ΔL_true split-half | ΔL_true all batches | ΔW_true split-half | ΔW_true all batches |",
                  "|---|---|---|---|---|"]
        for f, r in reliability.items():
            lines.append(f"| {f} | {r['dL_true']['split_half']:.2f} | {r['dL_true']['full']:.2f} | "
                         f"{r['dW_true']['split_half']:.2f} | {r['dW_true']['full']:.2f} |")
    table = "\n".join(lines)
    (out / "summary.md").write_text(f"Spearman rank correlation, predicted vs measured ({len(truth) // len(formats)} linears).\n\n"
                                    f"Command: `{result['command']}`\n\n{table}\n")
    print(table)
    print(f"statistics {stats_s:.1f}s, ground truth {truth_s:.1f}s; wrote {out}/results.json, scatter.png, summary.md")
    trainer.logger.close()
    return 0


# (predicted, measured) pairs whose Spearman correlation the validation reports.
PAIRS = [("dL_pred", "dL_true"), ("dL_pred_first", "dL_true"), ("dL_pred_second", "dL_true"), ("rel_err_y", "dL_true"),
         ("dW_pred", "dW_true"), ("dW_pred_wgrad", "dW_true_wgrad"), ("dW_pred_dgrad", "dW_true_dgrad")]


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """The options naming the validation checkpoint (``trained_trainer``'s arguments)."""
    ap.add_argument("--config", default="launch/configs/tiny.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--steps", type=int, default=300, help="BF16 training steps of the checkpoint")
    ap.add_argument("--run-dir", default="runs/validate_metrics", help="resumed if it has the checkpoint")


def trained_trainer(config: str, overrides: list[str], steps: int, run_dir: str) -> Trainer:
    """A BF16 trainer at ``steps`` (resumed from ``run_dir`` when it has a checkpoint, else trained there)."""
    cfg = load_config(config, overrides + [
        f"training.max_steps={steps}", f"training.run_dir={run_dir}", "training.resume=true",
        "snip.enabled=false", "precision.initial_plan=bf16", "training.progress=false"])
    trainer = Trainer(cfg)
    if trainer.step < steps:
        trainer.fit()
    return trainer


def ground_truth(trainer: Trainer, formats: tuple[str, ...], truth_batches: int) -> list[dict]:
    """Measured effects on the first ``truth_batches`` held-out micro-batches (``snip/truth.py``),
    one row per (linear, format): dL_true (fprop in f), dW_true (dgrad+wgrad in f), dW_true_wgrad,
    dW_true_dgrad (means over the batches), and each batch's value under ``"per_batch"``."""
    held = held_out_batches(trainer, truth_batches)
    loss_change = truth.loss_changes(trainer, formats, held)
    update_change = truth.update_changes(trainer, formats, held, gemms=("both", "wgrad", "dgrad"))
    rows = []
    for lin in trainer.model.precision_linears():
        key = key_of(lin)
        for f in formats:
            per_batch = {"dL_true": loss_change[key, f], "dW_true": update_change[key, f, "both"],
                         "dW_true_wgrad": update_change[key, f, "wgrad"],
                         "dW_true_dgrad": update_change[key, f, "dgrad"]}
            rows.append({"linear": key, "format": f, **{name: float(np.mean(v)) for name, v in per_batch.items()},
                         "per_batch": per_batch})
    return rows


def held_out_batches(trainer: Trainer, count: int) -> list[torch.Tensor]:
    """The first ``count`` training-sized micro-batches of the held-out split (the truth's data)."""
    return draw_micro_batches(trainer.data.valid["valid"], 0, count, trainer.cfg.training.micro_batch_size,
                              trainer.device)


def with_predictions(truth: list[dict], snapshot: dict) -> list[dict]:
    """``truth`` rows joined with what ``snapshot`` predicts for the same (linear, format),
    under the names ``PAIRS`` uses."""
    div = linear_divergences(snapshot)
    rows = []
    for row in truth:
        key, fmt = row["linear"], row["format"]
        d, s = div[key][fmt], snapshot["linears"][key]
        rows.append({**row, "dL_pred": d.loss, "dL_pred_first": d.loss_first_order,
                     "dL_pred_second": d.loss_second_order, "dW_pred": d.weight, "dW_pred_wgrad": d.weight_wgrad,
                     "dW_pred_dgrad": d.weight_dgrad, "curvature": curvature(s),
                     "prop_gain": propagation_gain(snapshot, key),
                     "rel_err_y": math.sqrt(s["per_format"][fmt]["sq_ey"] / s["sq_y"])})
    return rows


def correlations(rows: list[dict], formats: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Spearman ρ of every ``PAIRS`` entry, per format and over all rows ("all")."""
    corr = {f: {f"{p}~{q}": spearman([r[p] for r in rows if r["format"] == f], [r[q] for r in rows if r["format"] == f])
                for p, q in PAIRS} for f in formats}
    corr["all"] = {f"{p}~{q}": spearman([r[p] for r in rows], [r[q] for r in rows]) for p, q in PAIRS}
    return corr


def truth_reliability(rows: list[dict], formats: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """How reproducible the ground truth's ranking is: per format (and "all") and truth quantity,
    the Spearman ρ between its means over the even and the odd held-out batches (split half),
    and that stepped up to the full set of batches by Spearman-Brown, 2ρ/(1+ρ) (0 when ρ < 0). A
    prediction cannot be expected to correlate with the truth much beyond √(stepped-up ρ); with
    16 linears the estimate itself is rough."""
    def halves(r: dict, q: str) -> tuple[float, float]:
        v = r["per_batch"][q]
        return float(np.mean(v[0::2])), float(np.mean(v[1::2]))

    out = {}
    for f in (*formats, "all"):
        sel = [r for r in rows if f in ("all", r["format"])]
        out[f] = {}
        for q in ("dL_true", "dW_true"):
            a, b = zip(*(halves(r, q) for r in sel))
            rho = spearman(list(a), list(b))
            # A negative split-half ρ means no reproducible ranking: its stepped-up value is 0, not < 0.
            out[f][q] = {"split_half": rho, "full": 2 * rho / (1 + rho) if rho >= 0 else 0.0}
    return out


def plot(rows: list[dict], formats: tuple[str, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (p, q, title) in zip(axes, (("dL_pred", "dL_true", "loss divergence (fprop)"),
                                         ("dW_pred", "dW_true", "weight divergence (dgrad+wgrad)"))):
        for f in formats:
            xs = [r[p] for r in rows if r["format"] == f]
            ys = [r[q] for r in rows if r["format"] == f]
            ax.scatter(xs, ys, label=f, s=22, alpha=0.8)
        ax.set_xscale("log")
        _sparse_log_ticks(ax.xaxis)
        ax.set_xlabel(f"predicted {p}")
        ax.set_ylabel(f"measured {q}")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(title="format")
    axes[1].set_yscale("log")
    _sparse_log_ticks(axes[1].yaxis)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sparse_log_ticks(axis) -> None:
    """Labels at 1, 2, 5 x 10^k only, so a log axis spanning less than a decade still has some."""
    from matplotlib import ticker

    axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FormatStrFormatter("%.1g"))
    axis.set_minor_formatter(ticker.NullFormatter())


if __name__ == "__main__":
    sys.exit(main())
