"""What SNIP's metric says about depth: the tables of results.md's "Why `tail` wins" section.

    python docs/results/scale_4x_gemm/cost_by_block.py RUNS_DIR   # e.g. runs/s4g_plan

From each SNIP (plan budget) run's statistics snapshots (plans/step_*_stats.json) SNIP's own
normalized per-GEMM costs (``snip.metrics.snip_costs``, the ILP's inputs) are read; printed:
1. per block, the cost of running that block's GEMMs in fp4_block instead of fp8_block, split by
   fprop / dgrad / wgrad, mean over seeds and re-plans (each kind's total over blocks is a share
   of its normalizer: fprop sums to about 1, dgrad + wgrad to about 1);
2. per re-plan, the objective SNIP's costs give the plans that SNIP, `tail` and `bf16_ends` ran
   at that step (same seed), i.e. how much worse SNIP's metric thinks the rules' plans are.
"""

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from megatron_snip.snip.metrics import snip_costs

RUNS = Path(sys.argv[1])
STEM = "fp8_block-fp4_block_rho0.8"
GEMMS = ("fprop", "dgrad", "wgrad")
by_block = defaultdict(list)  # (layer, gemm) -> fp4 - fp8 cost, one per (seed, re-plan)
objectives = []  # (seed, step, {policy: objective})
for run in sorted(RUNS.glob(f"snip_{STEM}_seed*")):
    seed = int(re.search(r"seed(\d+)$", run.name).group(1))
    for stats_path in sorted((run / "plans").glob("step_*_stats.json")):
        snapshot = json.loads(stats_path.read_text())
        costs = snip_costs(snapshot)
        sums = defaultdict(float)
        for g, c in costs.items():
            sums[(g.layer, g.gemm)] += c["fp4_block"] - c["fp8_block"]
        for k, v in sums.items():
            by_block[k].append(v)
        plan_name = stats_path.name.replace("_stats", "")
        row = {}
        for policy in ("snip", "tail", "bf16-ends"):
            plan = RUNS / f"{policy}_{STEM}_seed{seed}" / "plans" / plan_name
            if plan.is_file():
                entries = json.loads(plan.read_text())["entries"]
                row[policy] = sum(c[entries[f"{g.layer}.{g.linear}.{g.gemm}"]] for g, c in costs.items())
        objectives.append((seed, snapshot["step"], row))

layers = sorted({k[0] for k in by_block})
n = len(next(iter(by_block.values())))
print(f"| block | {' | '.join(GEMMS)} |   (fp4_block - fp8_block cost, mean over {n} snapshots)\n|---|---|---|---|")
for layer in layers:
    print(f"| {layer} | " + " | ".join(f"{statistics.mean(by_block[(layer, g)]):.3f}" for g in GEMMS) + " |")
print("\n| seed | step | SNIP's plan | `tail`'s plan | `bf16_ends`'s plan |   (objective under SNIP's costs)\n|---|---|---|---|---|")
for seed, step, row in objectives:
    print(f"| {seed} | {step} | " + " | ".join(f"{row[p]:.3f}" if p in row else "-" for p in ("snip", "tail", "bf16-ends")) + " |")
