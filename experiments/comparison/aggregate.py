"""Statistics over seeds: per (policy, formats, rho) group, the final loss on one domain, its
spread, and the difference to the BF16 run of the same seed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from experiments.comparison.protocol import FORMAT_FREE_POLICIES, FORMAT_POLICIES, fmt_key


@dataclass(frozen=True)
class Row:
    """One (policy, formats, rho) group's final loss on one domain, over seeds."""

    policy: str
    formats: tuple[str, ...] | None
    rho: float | None
    domain: str
    n: int
    mean: float
    std: float  # sample std over seeds (ddof=1); nan with one seed
    gap_pct: float  # 100 * (mean - mean_bf16) / mean_bf16
    paired_mean: float  # mean over shared seeds of (loss - loss_bf16 of the same seed)
    paired_std: float  # sample std of those differences; nan with < 2 pairs
    n_pairs: int
    fp4_share: float | None  # mean over seeds of the final plan's FP4 FLOP share


def sample_std(x: Sequence[float]) -> float:
    return float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")


def by_seed(results: Iterable[dict], policy: str, formats, rho, domain: str) -> dict[int, float]:
    return {r["seed"]: float(r["final"][domain]) for r in results
            if r["policy"] == policy and fmt_key(r.get("formats")) == fmt_key(formats) and r.get("rho") == rho
            and domain in r.get("final", {})}


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, float, int]:
    """Mean and sample std of a[s] - b[s] over the seeds both have, and how many."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    return (float(np.mean(d)) if d else float("nan")), sample_std(d), len(d)


def group_order(groups: Iterable[tuple], format_sets: Sequence[tuple[str, ...]] = ()) -> list[tuple]:
    """(policy, formats, rho) groups in report order: format-free policies first, then per format
    set (in ``format_sets`` order, others after) by rho and the policy order of the module."""
    pol_rank = {pol: i for i, pol in enumerate(FORMAT_FREE_POLICIES + FORMAT_POLICIES)}
    fs_rank = {fs: i for i, fs in enumerate(format_sets)}
    return sorted(dict.fromkeys(groups), key=lambda g: (
        g[1] is not None, fs_rank.get(g[1], len(fs_rank)), g[1] or (), g[2] or 0.0, pol_rank.get(g[0], 99), g[0]))


def aggregate(results: Sequence[dict], domain: str, format_sets: Sequence[tuple[str, ...]] = ()) -> list[Row]:
    """One Row per (policy, formats, rho) present in ``results``, in report order."""
    groups = group_order(((r["policy"], fmt_key(r.get("formats")), r.get("rho")) for r in results), format_sets)
    ref = by_seed(results, "bf16", None, None, domain)
    ref_mean = float(np.mean(list(ref.values()))) if ref else float("nan")
    rows = []
    for pol, fs, rho in groups:
        vals = by_seed(results, pol, fs, rho, domain)
        if not vals:
            continue
        mean = float(np.mean(list(vals.values())))
        pm, ps, n_pairs = paired(vals, ref)
        shares = [r["fp4_share"] for r in results if r["policy"] == pol and fmt_key(r.get("formats")) == fs
                  and r.get("rho") == rho and r.get("fp4_share") is not None]
        rows.append(Row(pol, fs, rho, domain, len(vals), mean, sample_std(list(vals.values())),
                        100.0 * (mean - ref_mean) / ref_mean if ref else float("nan"), pm, ps, n_pairs,
                        float(np.mean(shares)) if shares else None))
    return rows


