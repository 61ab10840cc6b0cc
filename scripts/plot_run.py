"""Loss curves of one or more runs, side by side: one panel per metric, one line per run.

    python scripts/plot_run.py runs/tiny_bf16 runs/tiny_snip --out loss.png
    python scripts/plot_run.py runs/seed* --out val.png --metric val_loss --metric val_loss_moby_dick

Reads ``<run>/metrics.jsonl`` (written by the trainer's RunLogger) and ``<run>/config.toml``
for the legend: "<run dir name> (<policy>)", the policy being ``snip.policy`` when SNIP is on,
else ``precision.initial_plan``. Runs with the same policy share a colour and differ in line
style, so seeds of one policy read as a group. The y-axis is zoomed past the first
``--zoom-after`` fraction of steps (the initial loss drop would flatten everything else);
``--zoom-after 0`` shows the full range.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_snip.telemetry.run_reader import Run, load_run

DEFAULT_METRICS = ("loss", "val_loss")
LABELS = {"loss": "train loss (nats/token)", "val_loss": "validation loss (nats/token)",
          "val_ppl": "validation perplexity", "grad_norm": "gradient norm", "lr": "learning rate",
          "fp4_share": "FP4 share of linear FLOPs", "tokens_per_s": "tokens / s"}
LINESTYLES = ("-", "--", ":", "-.")


def axis_label(metric: str) -> str:
    if metric.startswith("val_loss_"):  # extra held-out corpora: val_loss_<name>
        return f"validation loss on {metric[len('val_loss_'):]} (nats/token)"
    return LABELS.get(metric, metric)


def plot_runs(runs: list[Run], metrics: list[str], out: str | Path, *, zoom_after: float = 0.1,
              title: str | None = None) -> Path:
    """Draw one panel per metric (side by side) with one line per run; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no runs to plot; pass at least one run directory")
    present = [m for m in metrics if any(m in r.series for r in runs)]
    if not present:
        have = sorted({k for r in runs for k in r.series})
        raise ValueError(f"none of the metrics {metrics} was logged by these runs; they have {have}")
    policies = list(dict.fromkeys(r.policy for r in runs))
    colors = plt.get_cmap("tab10").colors
    # Colour by policy, line style by the run's index within its policy (e.g. its seed).
    style_of = {id(r): LINESTYLES[[q for q in runs if q.policy == r.policy].index(r) % len(LINESTYLES)] for r in runs}
    fig, axes = plt.subplots(1, len(present), figsize=(6.4 * len(present), 4.6), squeeze=False)
    for ax, metric in zip(axes[0], present, strict=True):
        finite_tail: list[float] = []
        for run in runs:
            if metric not in run.series:
                continue
            steps, values = run.series[metric]
            ax.plot(steps, values, linestyle=style_of[id(run)], color=colors[policies.index(run.policy) % len(colors)],
                    marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.6, label=run.label)
            cut = steps[0] + zoom_after * (steps[-1] - steps[0])
            finite_tail += [v for s, v in zip(steps, values, strict=True) if s >= cut and math.isfinite(v)]
        if zoom_after > 0 and finite_tail:
            lo, hi = min(finite_tail), max(finite_tail)
            pad = 0.08 * (hi - lo) or 0.05 * abs(hi) or 0.1
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(axis_label(metric))
        ax.set_title(metric + (f" (y zoomed past the first {zoom_after:.0%} of steps)" if zoom_after > 0 else ""),
                     fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl and config.toml)")
    p.add_argument("--out", required=True, help="PNG to write, e.g. loss.png")
    p.add_argument("--metric", dest="metrics", action="append", default=None,
                   help=f"metric to plot, repeatable (default: {' and '.join(DEFAULT_METRICS)})")
    p.add_argument("--zoom-after", type=float, default=0.1,
                   help="fit the y-axis to steps after this fraction of the run (0 = full range; default 0.1)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    if not 0 <= args.zoom_after < 1:
        print(f"error: --zoom-after={args.zoom_after} must be in [0, 1)", file=sys.stderr)
        return 2
    try:
        runs = [load_run(r) for r in args.runs]
        out = plot_runs(runs, args.metrics or list(DEFAULT_METRICS), args.out, zoom_after=args.zoom_after,
                        title=args.title)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
