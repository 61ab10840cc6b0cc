"""Paired ablation table: each variant of a policy against a reference run of it, seed by seed.

    python -m experiments.ablation_table --bf16 runs/ablation/main \\
        --row "default=runs/ablation/main:snip:fp8_block,fp4_block" \\
        --row "granularity gemm=runs/ablation/gemm:snip:fp8_block,fp4_block" --out docs/results/ablation/table.md

Each ``--row NAME=OUT_DIR:POLICY[:FORMATS[@RHO]]`` names the runs of ``POLICY`` (a policy with an
argument written whole, ``uniform:fp4_block``; with candidate formats ``FORMATS``, comma-separated; omitted for format-free policies; ``@RHO`` picks one FP4
target where the out-dir holds several, as ``docs/results/comparison/`` does) in the comparison driver's
out-dir ``OUT_DIR`` (its ``results.jsonl``: the latest ok record of each run). The first row is the
reference. Per validation domain the table gives each row's paired Δ of the final loss against the
reference's run of the same seed (mean ± standard error over the seeds both have, and how many),
marked when it exceeds 2 SE over at least 3 pairs, and its paired Δ against the BF16 runs of
``--bf16``'s out-dir. ``--seeds 41,42`` restricts every row to those seeds (a study extended by more
seeds, reported both pooled and on the added seeds alone).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.cli import emit_page
from experiments.comparison.aggregate import paired
from experiments.comparison.report import standard_error
from experiments.comparison.store import latest_records, read_results
from megatron_snip.snip.policies import parse_policy


@dataclass(frozen=True)
class Row:
    name: str
    out_dir: Path
    policy: str
    formats: tuple[str, ...] | None
    rho: float | None = None

    @classmethod
    def parse(cls, text: str) -> Row:
        usage = (f"--row {text!r}: write NAME=OUT_DIR:POLICY[:FORMATS[@RHO]], e.g. "
                 "'default=runs/ablation/main:snip:fp8_block,fp4_block@0.8'")
        name, sep, spec = text.partition("=")
        parts = spec.split(":")
        if not sep or not name or len(parts) not in (2, 3, 4) or not all(parts):
            raise ValueError(usage)
        # A policy with an argument (``uniform:fp4_block``) keeps its colon; candidate formats follow it.
        joined = len(parts) == 4 or (len(parts) == 3 and _is_policy(f"{parts[1]}:{parts[2]}"))
        parts = [parts[0], f"{parts[1]}:{parts[2]}", *parts[3:]] if joined else parts
        formats, rho = (parts[2].partition("@")[::2]) if len(parts) == 3 else (None, "")
        try:
            rho_value = float(rho) if rho else None
        except ValueError:
            raise ValueError(f"{usage} (RHO {rho!r} is not a number)") from None
        return cls(name, Path(parts[0]), parts[1], tuple(formats.split(",")) if formats else None, rho_value)


def _is_policy(spec: str) -> bool:
    try:
        parse_policy(spec)
    except ValueError:
        return False
    return True


def finals(out_dir: Path, policy: str, formats: tuple[str, ...] | None,
           rho: float | None = None) -> dict[int, dict[str, float]]:
    """seed -> final losses per domain of ``policy``'s ok runs in ``out_dir`` (at FP4 target ``rho``
    if given; without it, the runs must all have one target)."""
    path = out_dir / "results.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no results.jsonl (run the comparison driver with --out-dir {out_dir} first)")
    out: dict[int, dict[str, float]] = {}
    rhos = set()
    for rec in latest_records(read_results(path)).values():
        if rec.get("status") == "ok" and rec["policy"] == policy and \
                (None if rec.get("formats") is None else tuple(rec["formats"])) == formats and \
                (rho is None or rec.get("rho") is not None and math.isclose(rec["rho"], rho)):
            rhos.add(rec.get("rho"))
            out[rec["seed"]] = {k: float(v) for k, v in rec.get("final", {}).items()}
    if len(rhos) > 1:
        raise ValueError(f"{path}: {policy} {','.join(formats or ())} ran at several FP4 targets "
                         f"{sorted(rhos)}; pick one with @RHO after the formats")
    return out


def cell(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], domain: str, *, verdict: bool) -> str:
    mean, std, n = paired({s: v[domain] for s, v in a.items() if domain in v},
                          {s: v[domain] for s, v in b.items() if domain in v})
    if n == 0:
        return "—"
    se = standard_error(std, n)
    # Two pairs give an SE with one degree of freedom: no verdict from fewer than three.
    mark = " **(> 2 SE)**" if verdict and n >= 3 and abs(mean) > 2 * se else ""
    return f"{mean:+.4f} ± {se:.4f} ({n}){mark}"


def table(rows: list[Row], bf16_dir: Path | None, seeds: frozenset[int] | None = None) -> str:
    """The markdown table; ``seeds``, if given, keeps only those seeds' runs (each must be in some row)."""
    runs = [finals(r.out_dir, r.policy, r.formats, r.rho) for r in rows]
    bf16 = finals(bf16_dir, "bf16", None) if bf16_dir is not None else {}
    if seeds is not None:
        absent = sorted(seeds - {s for per_seed in runs for s in per_seed})
        if absent:
            raise ValueError(f"--seeds {','.join(map(str, sorted(seeds)))}: no row has a run of seed(s) "
                             f"{','.join(map(str, absent))}; list seeds the rows' out-dirs hold")
        runs = [{s: v for s, v in per_seed.items() if s in seeds} for per_seed in runs]
        bf16 = {s: v for s, v in bf16.items() if s in seeds}
    domains = sorted({d for per_seed in runs for v in per_seed.values() for d in v},
                     key=lambda d: (d != "val_loss", d))
    head = ["variant", "seeds"] + [f"Δ vs {rows[0].name}: `{d}`" for d in domains] + \
        ([f"Δ vs BF16: `{d}`" for d in domains] if bf16 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, per_seed in zip(rows, runs):
        cells = [row.name, ",".join(map(str, sorted(per_seed))) or "none"]
        cells += ["reference" if row is rows[0] else cell(per_seed, runs[0], d, verdict=True) for d in domains]
        cells += [cell(per_seed, bf16, d, verdict=False) for d in domains] if bf16 else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", action="append", required=True, help="NAME=OUT_DIR:POLICY[:FORMATS[@RHO]]; the first is the reference")
    ap.add_argument("--bf16", type=Path, default=None, help="out-dir whose bf16 runs give the Δ vs BF16 columns")
    ap.add_argument("--seeds", type=_seeds, default=None, help="comma-separated seeds to keep (default: every seed)")
    ap.add_argument("--out", type=Path, default=None, help="write the table here (default: print it)")
    args = ap.parse_args(argv)
    return emit_page(lambda: table([Row.parse(r) for r in args.row], args.bf16, args.seeds), args.out)


def _seeds(text: str) -> frozenset[int]:
    try:
        return frozenset(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of seeds, e.g. 41,42") from None


if __name__ == "__main__":
    sys.exit(main())
