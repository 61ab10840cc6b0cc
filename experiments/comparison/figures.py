"""The report's loss-curve figures, one per candidate format set."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.comparison.aggregate import group_order
from experiments.comparison.protocol import Protocol
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.telemetry.run_reader import load_run


def _smooth(steps: list[int], values: np.ndarray, window: int) -> tuple[list[int], np.ndarray]:
    if len(values) <= window:
        return steps, values
    return steps[window - 1:], np.convolve(values, np.ones(window) / window, mode="valid")


def plot_curves(results: Sequence[dict], p: Protocol, formats: tuple[str, ...], out: Path) -> Path | None:
    """Curves at the primary rho for one format set, one column per validation domain plus the
    training loss (50-step moving average). Top row: mean over seeds. Bottom row: the paired
    difference to the BF16 run of the same seed, mean over seeds (where the policies differ;
    the top row's curves mostly overlap). Format-free policies appear in every figure (of the
    uniform FP4 ones this set's format, and those whose format is in no candidate set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def member(r: dict) -> bool:
        if r.get("formats") is None:
            fmt = r["policy"].split(":", 1)[1] if r["policy"].startswith("uniform:") else None
            return (fmt is None or fmt not in FP4_FORMATS or fmt in formats
                    or not any(fmt in fs for fs in p.format_sets))
        return tuple(r["formats"]) == formats and r.get("rho") == p.rho

    chosen = [r for r in results if member(r) and Path(r["run_dir"], "metrics.jsonl").is_file()]
    if not chosen:
        return None
    policies = [g[0] for g in group_order((r["policy"], None, None) for r in chosen)]
    metrics = [*p.domains, "loss"]
    # series[policy][metric][seed] = {step: value}
    series: dict[str, dict[str, dict[int, dict[int, float]]]] = {}
    for r in chosen:
        run = load_run(r["run_dir"])
        for metric in metrics:
            if metric in run.series:
                series.setdefault(r["policy"], {}).setdefault(metric, {})[r["seed"]] = dict(zip(*run.series[metric]))
    fig, axes = plt.subplots(2, len(metrics), figsize=(5.2 * len(metrics), 8.2), squeeze=False, sharex=True)
    colors = plt.get_cmap("tab10").colors
    for col, metric in enumerate(metrics):
        top, bottom = axes[0][col], axes[1][col]
        ref = series.get("bf16", {}).get(metric, {})
        tail: list[float] = []
        for i, pol in enumerate(policies):
            by_seed_steps = series.get(pol, {}).get(metric, {})
            if not by_seed_steps:
                continue
            style = {"color": colors[i % len(colors)], "linewidth": 1.5, "markersize": 3}
            steps = sorted(set.intersection(*(set(v) for v in by_seed_steps.values())))
            mean = np.array([np.mean([v[t] for v in by_seed_steps.values()]) for t in steps])
            xs, ys = _smooth(steps, mean, 50) if metric == "loss" else (steps, mean)
            top.plot(xs, ys, marker="o" if len(xs) <= 30 else None, label=f"{pol} (n={len(by_seed_steps)})", **style)
            tail += [float(v) for t, v in zip(xs, ys) if t >= 0.3 * p.steps and math.isfinite(v)]
            seeds = sorted(set(by_seed_steps) & set(ref))
            if pol != "bf16" and seeds:
                dsteps = sorted(set.intersection(*(set(by_seed_steps[s]) & set(ref[s]) for s in seeds)))
                diff = np.array([np.mean([by_seed_steps[s][t] - ref[s][t] for s in seeds]) for t in dsteps])
                xs, ys = _smooth(dsteps, diff, 50) if metric == "loss" else (dsteps, diff)
                bottom.plot(xs, ys, marker="o" if len(xs) <= 30 else None, **style)
        if tail:
            lo, hi = min(tail), max(tail)
            pad = 0.08 * (hi - lo) or 0.02
            top.set_ylim(lo - pad, hi + pad)
        name = "train loss (50-step mean)" if metric == "loss" else metric
        top.set_title(f"{name}, mean over seeds", fontsize=10)
        bottom.set_title("minus the BF16 run of the same seed, mean over seeds", fontsize=9)
        bottom.axhline(0.0, color="black", linewidth=0.8)
        top.set_ylabel("nats/token")
        bottom.set_ylabel("difference (nats/token)")
        bottom.set_xlabel("optimizer step")
        for ax in (top, bottom):
            ax.axvline(p.warmup, color="grey", linewidth=0.8, linestyle=":")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"formats {','.join(formats)}, rho={p.rho:g} (dotted line: policy applied at step {p.warmup}; "
                 f"top row zoomed past step {int(0.3 * p.steps)})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
