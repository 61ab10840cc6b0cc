"""Precision-plan figures: per-plan precision map, plan timeline, Pareto curve.

Callers import this module lazily (matplotlib is slow to import). Figures are built
with ``matplotlib.figure.Figure`` and rendered by the Agg canvas, so no pyplot
global state is touched and no display is needed. Every format has a fixed colour
across all figures so plots from different runs compare at a glance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from megatron_snip.precision.formats import FORMATS, base_format_name
from megatron_snip.precision.plan import GEMMS, LINEARS, GemmId, PrecisionPlan

# Fixed colour per format: greys/blues for high precision, warm colours for FP4.
FORMAT_COLORS: dict[str, str] = {
    "bf16": "#b0b0b0",
    "fp8": "#4c72b0",
    "fp8_block": "#64b5cd",
    "mxfp8": "#8172b2",
    "nvfp4": "#dd8452",
    "mxfp4": "#c44e52",
    "fp4_block": "#937860",
}
_LINEAR_LABEL = {"qkv": "qkv", "proj": "proj", "fc1": "fc1 (gate+up)", "fc2": "fc2 (down)"}
_DPI = 120


def _color(fmt: str) -> str:
    return FORMAT_COLORS[base_format_name(fmt)]


def _canonical(g: GemmId) -> tuple[int, int, int]:
    return (g.layer, LINEARS.index(g.linear), GEMMS.index(g.gemm))


def _palette(names: Iterable[str]) -> tuple[list[str], ListedColormap, BoundaryNorm]:
    """Formats present (base formats in FORMATS order, then recipe variants by name), a colormap with
    one colour each (a variant takes its base format's colour), and its integer norm."""
    names = set(names)
    present = [f for f in FORMATS if f in names] + sorted(names - set(FORMATS))
    cmap = ListedColormap([_color(f) for f in present]).with_extremes(bad="white")  # white = not in plan
    norm = BoundaryNorm(np.arange(len(present) + 1) - 0.5, len(present))
    return present, cmap, norm


def _legend_handles(
    present: Sequence[str], counts: dict[str, int] | None = None, gaps: bool = False
) -> list[Patch]:
    handles = [
        Patch(facecolor=_color(f), edgecolor="black", linewidth=0.5,
              label=f if counts is None else f"{f} ({counts.get(f, 0)} GEMMs)")
        for f in present
    ]
    if gaps:
        handles.append(Patch(facecolor="white", edgecolor="black", linewidth=0.5, label="not in plan"))
    return handles


def _tick_stride(n: int, max_labels: int) -> int:
    """Smallest 'nice' stride that keeps at most ``max_labels`` labels."""
    for stride in (1, 2, 4, 5, 10, 20, 25, 50, 100):
        if math.ceil(n / stride) <= max_labels:
            return stride
    return math.ceil(n / max_labels)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    return path


def plot_precision_map(plan: PrecisionPlan, path: str | Path, title: str | None = None) -> Path:
    """Heatmap of one plan: rows = blocks (layer 0 at the top), columns = the 12 GEMMs
    grouped by linear (qkv, proj, fc1, fc2 x fprop/dgrad/wgrad); colour = format.

    GEMMs absent from the plan are white. Readable from 4 to ~100 layers (layer labels
    thin out past ~40 rows). Returns the written path (PNG; parent dirs are created).
    """
    if not plan.entries:
        raise ValueError(f"plan (policy {plan.policy!r}, step {plan.step}) has no entries; nothing to plot")
    d = plan.as_dict()
    layers = sorted({g.layer for g in d})
    present, cmap, norm = _palette(d.values())
    code = {f: i for i, f in enumerate(present)}
    columns = [(lin, gemm) for lin in LINEARS for gemm in GEMMS]
    grid = np.full((len(layers), len(columns)), np.nan)
    for r, layer in enumerate(layers):
        for c, (lin, gemm) in enumerate(columns):
            fmt = d.get(GemmId(layer, lin, gemm))
            if fmt is not None:
                grid[r, c] = code[fmt]

    n = len(layers)
    fig = Figure(figsize=(7.5, min(max(0.2 * n + 2.2, 4.0), 22.0)))
    ax = fig.add_subplot()
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")

    ax.set_xticks(range(len(columns)), [gemm for _, gemm in columns], rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("GEMM (grouped by linear)")
    top = ax.secondary_xaxis("top")
    top.set_xticks([3 * i + 1 for i in range(len(LINEARS))], [_LINEAR_LABEL[lin] for lin in LINEARS], fontsize=9)
    top.tick_params(length=0)
    for x in (2.5, 5.5, 8.5):  # separate the linears
        ax.axvline(x, color="white", linewidth=3)
    if n <= 40:  # separate the blocks while the rows are tall enough to see it
        for y in np.arange(n - 1) + 0.5:
            ax.axhline(y, color="white", linewidth=0.6)
    stride = _tick_stride(n, 40)
    rows = list(range(0, n, stride))
    ax.set_yticks(rows, [str(layers[r]) for r in rows], fontsize=8 if n <= 40 else 7)
    ax.set_ylabel("block (layer)")

    counts = plan.format_counts()
    handles = _legend_handles(present, counts, gaps=bool(np.isnan(grid).any()))
    ax.legend(handles=handles, title="format", loc="upper left", bbox_to_anchor=(1.02, 1.0),
              fontsize=8, title_fontsize=9, frameon=False)
    subtitle = f"step {plan.step} · FP4 share {plan.fp4_flops_share:.1%} of linear FLOPs"
    if plan.solver_status is not None:
        subtitle += f" · {plan.solver_status}"
    if plan.objective is not None:
        subtitle += f" · objective {plan.objective:.4g}"
    ax.set_title(f"{title or f'precision plan: {plan.policy}'}\n{subtitle}", fontsize=10, pad=22)
    return _save(fig, path)


def plot_timeline(plans: Sequence[PrecisionPlan], path: str | Path, title: str | None = None) -> Path:
    """How each GEMM's format changed over training.

    x = training step (each plan is drawn from its step until the next plan's step; the
    last one for a median interval), y = GEMM rows ordered by layer, then linear, then
    GEMM (layer 0 at the top); colour = format. A strip above shows the FP4 FLOP share
    of each plan (and its target when the plan recorded one; under a run-level budget the
    interval's share, the run target and the budget still unspent after each plan). Plans are sorted by step;
    of several plans at one step the last in the list wins. Readable at 80 layers
    (960 rows): rows are then labelled per block, not per GEMM.
    """
    if not plans:
        raise ValueError("plot_timeline needs at least one plan; got an empty list")
    by_step: dict[int, PrecisionPlan] = {}
    for plan in plans:
        by_step[plan.step] = plan
    ordered = [by_step[s] for s in sorted(by_step)]
    if not any(p.entries for p in ordered):
        raise ValueError("plot_timeline: every plan is empty; nothing to plot")
    gids = sorted({g for p in ordered for g, _ in p.entries}, key=_canonical)
    row_of = {g: i for i, g in enumerate(gids)}
    present, cmap, norm = _palette(f for p in ordered for _, f in p.entries)
    code = {f: i for i, f in enumerate(present)}
    grid = np.full((len(gids), len(ordered)), np.nan)
    for c, plan in enumerate(ordered):
        for g, f in plan.entries:
            grid[row_of[g], c] = code[f]

    steps = np.array([p.step for p in ordered], dtype=float)
    tail = float(np.median(np.diff(steps))) if len(steps) > 1 else max(1.0, 0.1 * abs(steps[0]) or 1.0)
    x_edges = np.append(steps, steps[-1] + tail)
    y_edges = np.arange(len(gids) + 1)
    layers = sorted({g.layer for g in gids})

    # Heights in inches: a fixed strip for the share, the map sized by its rows (one
    # labelled line per GEMM when few, else ~0.16 in per block).
    main_h = 0.14 * len(gids) if len(gids) <= 48 else min(max(0.16 * len(layers) + 3.0, 4.5), 17.0)
    share_h = 1.1
    fig = Figure(figsize=(10.0, main_h + share_h + 1.4))
    grid_spec = fig.add_gridspec(2, 1, height_ratios=[share_h, main_h], hspace=0.25 / (main_h + share_h) * 4)
    ax_share = fig.add_subplot(grid_spec[0])
    ax = fig.add_subplot(grid_spec[1], sharex=ax_share)

    shares = [p.fp4_flops_share for p in ordered]
    ax_share.step(x_edges, [*shares, shares[-1]], where="post", color="black", linewidth=1.2, label="FP4 share")
    targets = [dict(p.extra).get("fp4_target") for p in ordered]
    if any(t is not None for t in targets):
        tt = [np.nan if t is None else t for t in targets]
        run = any(dict(p.extra).get("budget") == "run" for p in ordered)
        ax_share.step(x_edges, [*tt, tt[-1]], where="post", color="tab:red", linestyle="--", linewidth=1,
                      label="interval share" if run else "target ρ")
        if run:  # snip.budget="run": the run's target and the part of it still unspent after each plan
            rho = next(dict(p.extra)["run_target"] for p in ordered if dict(p.extra).get("budget") == "run")
            ax_share.axhline(rho, color="tab:red", linestyle=":", linewidth=1, label="run target ρ")
            left = [dict(p.extra).get("budget_unspent", np.nan) for p in ordered]
            ax_share.step(x_edges, [*left, left[-1]], where="post", color="tab:blue", linewidth=1,
                          label="budget unspent")
    ax_share.set_ylim(-0.05, 1.05)
    ax_share.set_ylabel("FP4\nshare", fontsize=8)
    ax_share.legend(loc="lower right", fontsize=7, frameon=False, ncol=2)
    ax_share.tick_params(labelbottom=False, labelsize=7)
    ax_share.grid(alpha=0.3)

    ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(grid), cmap=cmap, norm=norm, shading="flat")
    ax.set_ylim(len(gids), 0)  # layer 0 at the top
    per_layer = [sum(1 for g in gids if g.layer == layer) for layer in layers]
    starts = np.concatenate([[0], np.cumsum(per_layer)])
    if len(gids) <= 48:  # few rows: name every GEMM
        ax.set_yticks(np.arange(len(gids)) + 0.5, [g.key for g in gids], fontsize=7)
    else:  # many rows: one label per block, thinned to <= 40
        stride = _tick_stride(len(layers), 40)
        idx = list(range(0, len(layers), stride))
        ax.set_yticks([(starts[i] + starts[i + 1]) / 2 for i in idx], [str(layers[i]) for i in idx],
                      fontsize=8 if len(idx) <= 24 else 7)
    if len(layers) <= 40:
        for y in starts[1:-1]:
            ax.axhline(y, color="white", linewidth=0.8)
    ax.set_ylabel("block (layer) · rows: qkv, proj, fc1, fc2 × fprop, dgrad, wgrad")
    ax.set_xlabel("training step (plan in force)")
    if len(ordered) <= 20:
        ax.set_xticks(steps, [str(int(s)) for s in steps], rotation=45 if len(ordered) > 8 else 0, fontsize=8)
    handles = _legend_handles(present, gaps=bool(np.isnan(grid).any()))
    ax.legend(handles=handles, title="format", loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8, title_fontsize=9, frameon=False)
    policies = sorted({p.policy for p in ordered})
    head = title or f"precision timeline: {', '.join(policies)}"
    ax_share.set_title(
        f"{head}\n{len(ordered)} plan{'s' if len(ordered) > 1 else ''}, steps {ordered[0].step}–{ordered[-1].step}, "
        f"{len(layers)} blocks",
        fontsize=10,
    )
    return _save(fig, path)


def plot_pareto(points: Sequence[tuple[float, float]], path: str | Path, title: str | None = None,
                xlabel: str = "FP4 FLOP-share target ρ") -> Path:
    """Predicted objective (sum of normalized costs of the optimal plan) vs a target in [0, 1]:
    the FP4 target rho (``snip.ilp.pareto_curve``) or, with its ``xlabel``, a GEMM-time ratio.

    Points with an infinite objective (infeasible targets) are marked along the top edge.
    """
    if not points:
        raise ValueError("plot_pareto needs at least one (rho, objective) point; got an empty list")
    pts = sorted((float(r), float(o)) for r, o in points)
    ok = [(r, o) for r, o in pts if math.isfinite(o)]
    bad = [r for r, o in pts if not math.isfinite(o)]
    if not ok:
        raise ValueError(f"plot_pareto: every target is infeasible ({[r for r, _ in pts]}); nothing to plot")
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.add_subplot()
    ax.plot([r for r, _ in ok], [o for _, o in ok], marker="o", color="tab:blue", label="optimal plan")
    if bad:
        y_top = max(o for _, o in ok)
        ax.scatter(bad, [y_top] * len(bad), marker="x", color="tab:red", zorder=3, label="infeasible target")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("predicted objective (Σ normalized cost)")
    ax.set_xlim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title or "SNIP: predicted cost vs FP4 target", fontsize=10)
    return _save(fig, path)


__all__ = ["FORMAT_COLORS", "plot_pareto", "plot_precision_map", "plot_timeline"]
