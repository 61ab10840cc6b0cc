"""How far apart two 6.46M continuations of the same seed end when their plans are equally good:
the noise floor every SNIP-vs-rule comparison at this size sits on, and the seeds it takes to see a
given difference.

    python docs/results/noise_floor/noise_floor.py

Reads the committed records of five SNIP arms on the same four development bases (seeds 11-14, 6.46M,
ρ = 0.9 on fp8_block,fp4_block, per-GEMM, 300 WSD steps, 1,024 spread windows per domain): shipped
(``../preconditioner/results_pc4_plan.jsonl``, with ``bf16``), ``snip.preconditioner = "with_probe"``,
``snip.probe_batches = 4``, ``snip.cost_ema = 0.5`` and ``snip.weight_divergence = "loss"``. None of the
four beat the shipped arm by 2 SE, each pre-registered on its own page. Per domain, a two-way
decomposition of final loss minus the seed's BF16 run (arms x seeds, one run per cell): the arm
effect's F against the residual (df 4, 12), and the residual SD σ (one run's deviation from its arm
and seed means; with no arm effect the pooled within-seed SD over 16 df says the same). A paired
difference of two runs of one seed then has SD σ√2, and n seeds give it SE σ√(2/n): seeing a true
difference Δ at 2 SE takes n = (2σ√2 / Δ)² seeds on average, and n = ((2 + 0.84)σ√2 / Δ)² for 80% power.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = {
    "shipped": "../preconditioner/results_pc4_plan.jsonl",
    "preconditioner with_probe": "../preconditioner/results_pc4_probe.jsonl",
    "probe_batches 4": "../probe_batches/results_pb4_probe4.jsonl",
    "cost_ema 0.5": "../cost_ema/results_ce4_ema.jsonl",
    "weight_divergence loss": "../loss_units/results_lu4_loss.jsonl",
}
SEEDS = (11, 12, 13, 14)
DOMAINS = ("val_loss", "val_loss_moby_dick", "val_loss_python_docs")
# Differences to see, in nats on the training domain: what a plan exactly at BF16 would gain over
# NVIDIA's tail+switch at 6.46M, rho = 0.9 (8 seeds, ../scale_4x_gemm/seeds41_results.md), and half of it.
TARGETS = {"a plan at BF16 vs tail+switch": 0.0028, "half of that": 0.0014}


def finals(path: Path) -> dict[tuple[str, int], dict[str, float]]:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["policy"] in ("snip", "bf16") and r["status"] == "ok":
            out[(r["policy"], r["seed"])] = r["final"]
    return out


def two_way(table: list[list[float]]) -> tuple[float, float]:
    """(F of the row effect, residual SD) of a rows x columns table, one value per cell."""
    a, b = len(table), len(table[0])
    grand = sum(map(sum, table)) / (a * b)
    rows = [sum(r) / b for r in table]
    cols = [sum(table[i][j] for i in range(a)) / a for j in range(b)]
    ss_rows = b * sum((m - grand) ** 2 for m in rows)
    ss_res = sum((table[i][j] - rows[i] - cols[j] + grand) ** 2 for i in range(a) for j in range(b))
    df_rows, df_res = a - 1, (a - 1) * (b - 1)
    ms_res = ss_res / df_res
    return (ss_rows / df_rows) / ms_res, math.sqrt(ms_res)


def main() -> None:
    records = {arm: finals(HERE / path) for arm, path in ARMS.items()}
    bf16 = records["shipped"]
    print("| domain | arm effect F (df 4, 12) | σ: one run's residual SD | SE of a paired difference, 4 / 8 / 16 seeds |")
    print("|---|---|---|---|")
    sigmas = {}
    for dom in DOMAINS:
        table = [[records[arm][("snip", s)][dom] - bf16[("bf16", s)][dom] for s in SEEDS] for arm in ARMS]
        f, sigma = two_way(table)
        sigmas[dom] = sigma
        ses = " / ".join(f"{sigma * math.sqrt(2 / n):.4f}" for n in (4, 8, 16))
        print(f"| `{dom}` | {f:.2f} | {sigma:.4f} | {ses} |")
    sigma = sigmas["val_loss"]
    print("\nSeeds needed on the training domain (σ as above):\n")
    print("| true difference | nats | seeds for 2 SE on average | seeds for 80% power at 2 SE |")
    print("|---|---|---|---|")
    for name, delta in TARGETS.items():
        mean_n = (2 * sigma * math.sqrt(2) / delta) ** 2
        power_n = ((2 + 0.84) * sigma * math.sqrt(2) / delta) ** 2
        print(f"| {name} | {delta:.4f} | {math.ceil(mean_n)} | {math.ceil(power_n)} |")


if __name__ == "__main__":
    main()
