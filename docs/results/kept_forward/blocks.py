"""protocol_blocks.md: which blocks' forward GEMMs cost at evaluation, on ``kept1``'s final weights (all 8
blocks) and ``tail+switch``'s (blocks 0-3), development bases 11-14, order 0.

    python docs/results/kept_forward/blocks.py > docs/results/kept_forward/table_blocks.md

Reads ``evals_blocks/o0_<run>_block_<b>.json`` (the final checkpoint in its last plan cut to block b's
forward GEMMs, BF16 elsewhere), the runs' BF16 and own-plan re-evaluations and last plans
(``evals_kf1/`` for ``kept1``, ``../forward_split/evals/`` for ``tail+switch``). F_b = E(block b's cut) −
E(BF16); mean ± SE over the 4 bases. Then SNIP's own price of each block's forward GEMMs: the mean over a
block's 4 forward GEMMs of cost(fp4_block) − cost(fp8_block) (``snip.metrics.snip_costs``, fractions of
the whole model's total) in the last statistics snapshot of each run of shipped ``snip``
(forward_split's) and ``kept1``, ``stats/<arm>_o0_<run>_stats.json``, and each block's rank among the 8.
"""

from __future__ import annotations

import json
import statistics
import sys
from math import sqrt
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "forward_split"))
from forward_split import BASES, DOMAINS, FP4_FORMATS, evaluated

from megatron_snip.snip.metrics import snip_costs

ARMS = {"kept1": ("snip", HERE / "evals_kf1", range(8)),
        "tail+switch": ("tail-switch", HERE.parent / "forward_split" / "evals", range(4))}  # arm -> (run, evals, blocks)


def run_name(arm: str, base: int) -> str:
    return f"o0_{ARMS[arm][0]}_fp8_block-fp4_block_rho0.9_seed{base}"


def fp4_fprops(arm: str, base: int, block: int) -> int:
    """FP4 forward GEMMs of ``block`` in the run's last plan."""
    entries = json.loads((ARMS[arm][1] / f"{run_name(arm, base)}_plan.json").read_text())["entries"]
    return sum(f in FP4_FORMATS for g, f in entries.items() if g.startswith(f"{block}.") and g.endswith(".fprop"))


def forward_cost(arm: str, base: int, what: str) -> dict[str, float]:
    """{domain: E(W, plan) − E(W, BF16)}: ``what`` = ``block_<b>`` or ``checkpoint`` (the whole last plan)."""
    where = HERE / "evals_blocks" if what.startswith("block_") else ARMS[arm][1]
    e, ref = (evaluated(p / f"{run_name(arm, base)}_{w}.json") for p, w in ((where, what), (ARMS[arm][1], "bf16")))
    return {d: e[d] - ref[d] for d in DOMAINS}


def per_fprop(arm: str, f: dict, base: int, group: range) -> float:
    """The training domain's sum of F_b over ``group``'s blocks per FP4 forward GEMM in them."""
    return sum(f[b][base]["val_loss"] for b in group) / max(1, sum(fp4_fprops(arm, base, b) for b in group))


def cell(xs: list[float]) -> str:
    m, se = statistics.fmean(xs), statistics.stdev(xs) / sqrt(len(xs))
    return f"{m:+.4f} ± {se:.4f}"


def main() -> None:
    for arm, (_, _, blocks) in ARMS.items():
        f = {b: {base: forward_cost(arm, base, f"block_{b}") for base in BASES} for b in blocks}
        print(f"## `{arm}`: F_b, block b's forward GEMMs alone (mean ± SE over bases {', '.join(map(str, BASES))})\n")
        print("| block | FP4 fprops (per base) | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |")
        print("|---|---|" + "---|" * len(DOMAINS))
        for b in blocks:
            n = [fp4_fprops(arm, base, b) for base in BASES]
            print(f"| {b} | {', '.join(map(str, n))} | " + " | ".join(cell([f[b][base][d] for base in BASES])
                                                              for d in DOMAINS) + " |")
        whole = {base: forward_cost(arm, base, "checkpoint") for base in BASES}
        print("| sum over these blocks | | " + " | ".join(cell([sum(f[b][base][d] for b in blocks) for base in BASES])
                                                        for d in DOMAINS) + " |")
        print("| the whole last plan | | " + " | ".join(cell([whole[base][d] for base in BASES]) for d in DOMAINS) + " |\n")
        if arm != "kept1":
            continue

        diff = [per_fprop(arm, f, base, range(4)) - per_fprop(arm, f, base, range(4, 8)) for base in BASES]
        m, se = statistics.fmean(diff), statistics.stdev(diff) / sqrt(len(diff))
        print(f"Training domain, F per FP4 forward GEMM, blocks 0-3 − blocks 4-7 (paired over bases): "
              f"{m:+.5f} ± {se:.5f} ({m / se:+.1f} SE); per base: {', '.join(f'{x:+.5f}' for x in diff)}.\n")


def prices() -> None:
    """Table 3: SNIP's FP4 − FP8 price of each block's forward GEMMs in each run's last snapshot."""
    print("## 3. SNIP's price of each block's forward GEMMs (last snapshot; mean FP4 − FP8 cost, ×1000)\n")
    print("| arm | base | " + " | ".join(f"block {b}" for b in range(8)) + " | block 0's rank |")
    print("|---|---|" + "---|" * 8 + "---|")
    for arm in ("snip", "kept1"):
        for base in BASES:
            costs = snip_costs(json.loads((HERE / "stats" / f"{arm}_o0_snip_fp8_block-fp4_block_rho0.9_seed{base}_stats.json")
                                          .read_text()))
            row = [statistics.fmean(c["fp4_block"] - c["fp8_block"] for g, c in costs.items()
                                    if g.layer == b and g.gemm == "fprop") for b in range(8)]
            rank = 1 + sum(x > row[0] for x in row)
            print(f"| `{arm}` | {base} | " + " | ".join(f"{1000 * x:.1f}" for x in row) + f" | {rank} |")


if __name__ == "__main__":
    main()
    prices()
