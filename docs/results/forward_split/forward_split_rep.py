"""The forward/weights split of protocol_rep.md on the reported seeds: ``../goal_1x/``'s BF16, shipped
``snip``, ``tail+switch`` and ``snip+switch`` continuations of bases 1-4 at data orders 0 and 1, rerun
with their final checkpoints kept.

    python docs/results/forward_split/forward_split_rep.py > docs/results/forward_split/table_rep.md

Reads ``results_fsr_o<k>_plan.jsonl`` (BF16, ``snip``) and ``results_fsr_o<k>_run.jsonl`` (``tail+switch``,
``snip+switch``), and ``evals_rep/`` as ``forward_split.py`` reads ``evals/`` (whose split and tables
these are). Checks: each rerun's recorded final losses against ``../goal_1x/``'s record of the same arm,
base and order, and the order-0 re-evaluations in their own plan against the recorded final losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "replicas"))
sys.path.insert(0, str(HERE))
from forward_split import CONTRASTS, counts, own_plan_check, records, report, split, whole  # one split
from replicas import DOMAINS

ORDERS = (0, 1)
BASES = (1, 2, 3, 4)
ARMS = {p: p for p in ("bf16", "snip", "tail+switch", "snip+switch")}
EVALS = HERE / "evals_rep"
GOAL_1X = HERE.parent / "goal_1x"


def sources(prefix: str, where: Path) -> list[tuple[Path, int]]:
    return [(where / f"results_{prefix}_o{k}_{kind}.jsonl", k) for k in ORDERS for kind in ("plan", "run")]


def main() -> None:
    recs = records(sources("fsr", HERE), ARMS)
    keys = whole(recs, [(b, k) for b in BASES for k in ORDERS])
    g1 = records(sources("g1", GOAL_1X), ARMS)
    repro = [abs(recs[a][key]["final"][d] - g1[a][key]["final"][d]) for a in ARMS for key in keys if key in g1[a]
             for d in DOMAINS]
    n, worst = own_plan_check(recs, keys, EVALS)
    print(f"(base, order) pairs with every arm finished: {len(keys)} (orders {', '.join(map(str, sorted({k for _, k in keys})))}).\n")
    print(f"Checks: each rerun's final losses against ../goal_1x/'s record of the same run, largest |difference| "
          f"over {len(repro)} losses: {max(repro):.2e}; the order-0 re-evaluations in their own plan against the "
          f"recorded final losses, over {n}: {worst:.2e}.\n")
    parts = split(recs, keys, lambda arm: EVALS)
    report(parts, keys, CONTRASTS, counts({a: recs[a] for a in parts}, keys, lambda arm: EVALS))


if __name__ == "__main__":
    main()
