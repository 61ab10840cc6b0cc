"""Scale trend: one comparison's policies at several model sizes, side by side.

    python -m experiments.scale_trend --size "1.66M=docs/results/comparison" --size "6.46M=docs/results/scale_4x" \\
        --formats fp8_block,fp4_block --rho 0.8 --out docs/results/scale_trend/results_scale.md

Each ``--size NAME=OUT_DIR`` names a comparison driver's out-dir (its ``results.jsonl``: the latest
ok record of each run; ``docs/results/comparison/`` and ``docs/results/scale_4x/`` hold the committed ones). Per
validation domain and size the page gives, for every policy of ``--policies`` run at ``--formats``
and ``--rho``:

- its paired Δ vs BF16: mean over seeds of (final loss − the BF16 run's of the same seed) ± its
  standard error (sample std / √pairs), and how many pairs;
- the share of uniform FP4's gap it recovers, ``1 − mean Δ_policy / mean Δ_uniform`` over the
  seeds that ran both, ± its delta-method standard error (the ratio linearized per seed:
  ``z_s = (Δ_policy,s − r·Δ_uniform,s) / mean Δ_uniform``, SE = std(z)/√n). The linearization
  holds while uniform's mean gap is several of its SEs, so the share is left out ("n/a") where
  that gap is under 2 SE or has no SE (one seed), and the page prints the ratio below the table;

and SNIP's paired Δ against each other policy per size, with the change between the first and
last size ± the two SEs combined in quadrature (the sizes' seeds are separate experiments).

``--references NAME=OUT_DIR`` reads size NAME's references (``bf16`` and ``uniform:fp4_block``)
from another out-dir: one whose runs continued from the same bases under the same protocol, as an
ablation's out-dir does when it copies its bases and runs only the policies it varies.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from experiments.ablation_table import finals
from experiments.cli import emit_page, named_path
from experiments.comparison.aggregate import paired, sample_std
from experiments.comparison.report import plus_minus, standard_error

UNIFORM = "uniform:fp4_block"
DEFAULT_POLICIES = (UNIFORM, "bf16_ends", "random", "snip")
PerSeed = Mapping[int, float]


def paired_se(a: PerSeed, b: PerSeed) -> tuple[float, float, int]:
    """Mean of a[s] - b[s] over shared seeds, its standard error (nan under 2 pairs), and the count."""
    mean, std, n = paired(a, b)
    return mean, standard_error(std, n), n


def recovered_share(policy: PerSeed, uniform: PerSeed, bf16: PerSeed) -> tuple[float, float, int]:
    """``1 - mean(policy - bf16) / mean(uniform - bf16)`` over the seeds all three ran, its
    delta-method standard error (nan under 2 seeds), and the seed count."""
    seeds = sorted(set(policy) & set(uniform) & set(bf16))
    if not seeds:
        return float("nan"), float("nan"), 0
    d_pol = np.array([policy[s] - bf16[s] for s in seeds])
    d_uni = np.array([uniform[s] - bf16[s] for s in seeds])
    ratio = d_pol.mean() / d_uni.mean()
    z = (d_pol - ratio * d_uni) / d_uni.mean()
    return float(1 - ratio), standard_error(sample_std(z), len(seeds)), len(seeds)


def _cell(mean: float, se: float, n: int | None = None, spec: str = ".4f") -> str:
    """``+mean ± se (n)``; "—" without pairs; no count when ``n`` is None."""
    if n == 0:
        return "—"
    return plus_minus(mean, se, spec, signed=True) + ("" if n is None else f" ({n})")


def domain_tables(sizes: Sequence[tuple[str, dict[str, dict[int, dict[str, float]]]]],
                  policies: Sequence[str], domain: str) -> list[str]:
    """Two markdown tables for one domain: each policy's Δ vs BF16 and recovered share per size,
    and SNIP against each other policy per size with the change from the first size to the last."""
    def on(per_seed: dict[int, dict[str, float]]) -> dict[int, float]:
        return {s: v[domain] for s, v in per_seed.items() if domain in v}

    # Uniform's gap to BF16 per size: a share of it means something only where it is > 2 SE.
    uniform_gap = [paired_se(on(runs[UNIFORM]), on(runs["bf16"])) for _, runs in sizes]
    clear = [n >= 2 and mean > 2 * se for mean, se, n in uniform_gap]
    head = ["policy"] + [f"{name}: {col}" for name, _ in sizes
                         for col in ("Δ vs BF16 (± SE, pairs)", "share of uniform's gap recovered (± SE)")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pol in policies:
        cells = [f"`{pol}`"]
        for (_, runs), gap_is_clear in zip(sizes, clear):
            bf16, uni, this = on(runs["bf16"]), on(runs[UNIFORM]), on(runs[pol])
            cells.append(_cell(*paired_se(this, bf16)))
            if pol == UNIFORM:
                cells.append("reference")
            elif not gap_is_clear:
                cells.append("n/a")
            else:
                cells.append(_cell(*recovered_share(this, uni, bf16), spec=".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    t_ratios = "; ".join(f"{name} " + ("—" if n < 2 or se == 0 else f"{mean / se:.1f}")
                         for (name, _), (mean, se, n) in zip(sizes, uniform_gap))
    lines += [f"Uniform's mean gap to BF16 in SEs (the recovered share needs > 2): {t_ratios}.", ""]
    if "snip" not in policies:
        return lines
    first, last = sizes[0][0], sizes[-1][0]
    head = ["SNIP −"] + [name for name, _ in sizes] + ([f"change {first} → {last} (± SE)"] if len(sizes) > 1 else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pol in ["bf16", *policies]:
        if pol == "snip":
            continue
        deltas = [paired_se(on(runs["snip"]), on(runs[pol])) for _, runs in sizes]
        cells = [f"`{pol}`"] + [_cell(*d) for d in deltas]
        if len(sizes) > 1:
            (m0, se0, _), (m1, se1, _) = deltas[0], deltas[-1]
            cells.append(_cell(m1 - m0, math.hypot(se0, se1)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def page(sizes: Sequence[tuple[str, Path]], formats: tuple[str, ...], rho: float,
         policies: Sequence[str] = DEFAULT_POLICIES, command: str | None = None,
         references: Mapping[str, Path] | None = None) -> str:
    """The markdown page: per domain, ``domain_tables`` over the sizes (each a (name, out-dir));
    ``references`` maps a size's name to the out-dir its ``bf16`` and uniform runs are read from
    (default: its own)."""
    if UNIFORM not in policies:
        raise ValueError(f"--policies {';'.join(policies)!r} must include {UNIFORM!r}: the recovered share is of its gap")
    references = dict(references or {})
    unknown = sorted(set(references) - {name for name, _ in sizes})
    if unknown:
        raise ValueError(f"--references {', '.join(unknown)}: no --size of that name (sizes: "
                         f"{', '.join(name for name, _ in sizes)})")
    loaded = []
    for name, out_dir in sizes:
        ref_dir = references.get(name, out_dir)
        runs = {"bf16": finals(ref_dir, "bf16", None), UNIFORM: finals(ref_dir, UNIFORM, None)}
        for pol in policies:
            if pol not in runs:
                runs[pol] = finals(out_dir, pol, formats, rho)
        missing = [pol for pol, per_seed in runs.items() if not per_seed]
        if missing:
            where = out_dir if ref_dir == out_dir else f"{out_dir} (references: {ref_dir})"
            raise ValueError(f"{where}/results.jsonl: no ok runs of {', '.join(missing)} "
                             f"(formats {','.join(formats)}, rho {rho}); check --size, --references, --formats and --rho")
        loaded.append((name, runs))
    domains = sorted({d for _, runs in loaded for per_seed in runs.values() for v in per_seed.values() for d in v},
                     key=lambda d: (d != "val_loss", d))
    lines = ["# SNIP's margins at several model sizes", ""]
    if command:
        lines += ["Generated by `experiments/scale_trend.py`; do not edit by hand. Command:", "",
                  "```bash", command, "```", ""]
    lines += [f"Candidates `{','.join(formats)}` at rho = {rho}; sizes: "
             + ", ".join(f"{name} (`{out_dir}`" + (f", references from `{references[name]}`" if name in references else "")
                         + ")" for name, out_dir in sizes) + ". "
             "Δ vs BF16: mean over seeds of (final loss − the BF16 run's of the same seed), in nats, "
             "± standard error (pairs). Share of uniform's gap recovered: 1 − mean Δ / mean Δ of "
             f"`{UNIFORM}`, ± its delta-method SE. SNIP −: SNIP's paired Δ against each policy "
             "(negative: SNIP better); the change is last size minus first (positive: SNIP did "
             "relatively worse at the larger size), ± the two SEs in quadrature.", ""]
    for domain in domains:
        title = "training domain" if domain == "val_loss" else "other domain"
        lines += [f"### {title}: `{domain}`", ""] + domain_tables(loaded, policies, domain)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", action="append", required=True, help="NAME=OUT_DIR, smallest first")
    ap.add_argument("--formats", required=True, help="candidate formats of the format-taking policies, e.g. fp8_block,fp4_block")
    ap.add_argument("--rho", type=float, required=True, help="FP4 target of the format-taking policies")
    ap.add_argument("--policies", default=";".join(DEFAULT_POLICIES),
                    help=f"';'-separated policies to tabulate, {UNIFORM!r} among them (default: %(default)s)")
    ap.add_argument("--references", action="append", default=[],
                    help="NAME=OUT_DIR: read size NAME's bf16 and uniform runs from OUT_DIR (same bases and protocol)")
    ap.add_argument("--out", type=Path, default=None, help="write the page here (default: print it)")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "-m", "experiments.scale_trend", *(sys.argv[1:] if argv is None else argv)])
    return emit_page(lambda: page([named_path("--size", s, "1.66M=docs/results/comparison") for s in args.size],
                                  tuple(args.formats.split(",")), args.rho,
                                  [p for p in args.policies.split(";") if p], command,
                                  dict(named_path("--references", r, "1.66M=runs/budget_plan") for r in args.references)),
                 args.out)


if __name__ == "__main__":
    sys.exit(main())
