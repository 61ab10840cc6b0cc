"""Can the goal "SNIP beats the rule by > 2 SE" be met at all with these seeds? The headroom table.

    python docs/results/scale_4x_gemm/headroom.py [--rho 0.8] RECORDS.jsonl [RECORDS.jsonl ...]

(the ρ = 0.8 table: results_plan.jsonl results_random.jsonl; ρ = 0.9: --rho 0.9 results_rho09.jsonl
results_rho09_run.jsonl results_plan.jsonl, the last for the BF16 and uniform runs of the same bases).
SNIP is the shipped default: its plan-budget runs only; a rule is read whatever its budget
(`tail+switch` runs under the run budget).

Per rule, on the training domain (``val_loss``), paired by seed: the rule's gap to BF16, rule − BF16;
SNIP − rule as measured; and the best SNIP could do if it trained exactly as BF16 on every seed
(SNIP − rule = BF16 − rule, whose SE is the spread of the rule's own gap). The goal needs SNIP − rule
< −2 SE; where even the BF16 bound misses it, no plan at this FP4 share can meet it on these seeds.
The seeds it would take (n ≥ (2·sd / |mean|)², the bound's per-seed spread and mean held) close the table.
"""

import argparse
import json
import math
from pathlib import Path

from experiments.comparison.aggregate import by_seed, paired

FAMILY = ("fp8_block", "fp4_block")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rho", type=float, default=0.8, help="FP4 target of the runs to tabulate")
parser.add_argument("records", nargs="+", help="results.jsonl files")
args = parser.parse_args()
RHO = args.rho
records = [json.loads(line) for path in args.records for line in Path(path).read_text().splitlines()]
records = [r for r in records if r.get("status") == "ok"]
bf16 = by_seed(records, "bf16", None, None, "val_loss")
snip = by_seed([r for r in records if r.get("config", {}).get("snip", {}).get("budget", "plan") == "plan"],
               "snip", FAMILY, RHO, "val_loss")


def cell(mean: float, sd: float, n: int) -> str:
    return f"{mean:+.4f} ± {sd / math.sqrt(n):.4f}"


print("| rule | rule − BF16 | SNIP − rule | bound: BF16 − rule | bound < −2 SE? | seeds the bound needs |")
print("|---|---|---|---|---|---|")
for rule, formats in (("tail", FAMILY), ("tail+switch", FAMILY), ("bf16_ends", FAMILY), ("attn_protected", FAMILY), ("mlp_only", FAMILY),
                      ("random", FAMILY), ("uniform:fp4_block", None)):
    ruled = by_seed(records, rule, formats, RHO if formats else None, "val_loss")
    if not ruled:  # not in the records given
        continue
    gap, gap_sd, n = paired(ruled, bf16)
    diff, diff_sd, m = paired(snip, ruled)
    bound, bound_sd = -gap, gap_sd  # BF16 − rule per seed
    met = bound < -2 * bound_sd / math.sqrt(n)
    need = math.ceil((2 * bound_sd / abs(bound)) ** 2) if bound < 0 else "never (the rule is at BF16)"
    print(f"| `{rule}` | {cell(gap, gap_sd, n)} | {cell(diff, diff_sd, m)} | {cell(bound, bound_sd, n)} | "
          f"{'yes' if met else 'no'} | {need} |")
