"""protocol.md: at ρ = 0.8 the run budget over the whole share range (``snip.budget_share_range = [0.0,
1.0]``) for ``tail+switch``, ``snip+switch`` and ``snip`` (arms ``tail+switch@0-1``, ``snip+switch@0-1``,
``snip/run@0-1``) on the reported seeds' 1.66M bases 1-4 × data orders 0-3, against
``../goal_1x_rho08/``'s shipped ``snip``, ``tail+switch`` and ``snip+switch`` (default grid) and goal_1x's
BF16 and uniform ``fp4_block`` of the same bases and orders.

    python docs/results/full_switch_rho08/f8.py > docs/results/full_switch_rho08/table.md

Reads ``results_f8_o<k>.jsonl`` (the new arms), ``results_f8r_o<k>.jsonl`` (orders 0-1: this commit's
``tail+switch`` and ``snip+switch`` at the default grid, the check against goal_1x_rho08's records and the
split's references), ``plans/o<k>_<run>_step_<N>.json`` (every plan of every new run: the schedule and
the modelled GEMM time), and for the split ``evals_new/`` and ``evals_ref/``
(``o<k>_<run>_{checkpoint,bf16,plan}.json``) with ``../forward_split/``'s reported-seed BF16 reruns. The
tables are goal_1x.py's, the spent table full_switch/fw.py's and the split forward_split.py's (imported:
one place each).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
for folder in ("replicas", "goal_replicas", "goal_1x", "forward_split", "full_switch", "goal_1x_rho08"):
    sys.path.insert(0, str(RESULTS / folder))
import goal_1x  # the design, its tables and its references
import rho08  # the default-grid arms at ρ = 0.8
from forward_split import counts, eval_file, own_plan_check, records, report, split, whole
from fw import schedule_and_time

NEW = {"tail+switch": "tail+switch@0-1", "snip+switch": "snip+switch@0-1", "snip": "snip/run@0-1"}  # policy -> arm
REFS = ("tail+switch", "snip+switch")  # rerun at orders 0-1 at the default grid: the check and the split
SPLIT_ORDERS = (0, 1)
FS = RESULTS / "forward_split"


def new_records(order: int) -> Path:
    return HERE / f"results_f8_o{order}.jsonl"


def ref_records(order: int) -> Path:
    return HERE / f"results_f8r_o{order}.jsonl"


def load() -> goal_1x.Runs:
    """goal_1x_rho08's arms (with goal_1x's BF16 and uniform) and the new ones, orders every arm finished on every base."""
    runs = {arm: goal_1x.arm_runs(arm, lambda k, arm=arm: rho08.records_path(arm, k)) for arm in goal_1x.ARMS}
    for policy, arm in NEW.items():
        runs[arm] = goal_1x.arm_runs(policy, new_records)
    return goal_1x.whole_orders(runs)


def checks() -> None:
    for k in SPLIT_ORDERS:
        for policy in REFS:
            goal_1x.check_against_records(f"this commit's `{policy}` at the default share grid", ref_records(k), policy,
                                          order=k, reference=rho08.records_path(policy, k))


def splits() -> None:
    """The forward/weights split at orders 0-1 (forward_split's definitions), on the (base, order) pairs every arm has."""
    print("\n## The split at orders 0-1 (forward_split's definitions; BF16: its reported-seed reruns)\n")
    recs = records([(FS / f"results_fsr_o{k}_plan.jsonl", k) for k in SPLIT_ORDERS], {"bf16": "bf16"})
    recs |= records([(ref_records(k), k) for k in SPLIT_ORDERS], {p: p for p in REFS})
    recs |= records([(new_records(k), k) for k in SPLIT_ORDERS], NEW)
    keys = [key for key in whole(recs, [(b, k) for b in goal_1x.BASES for k in SPLIT_ORDERS])
            if all(eval_file(where(arm), key, recs[arm][key], "bf16").is_file() for arm in recs if arm != "bf16")]
    if not keys:
        print("No (base, order) with every arm's evaluations: no split.")
        return
    n, worst = own_plan_check({a: recs[a] for a in NEW.values()}, keys, HERE / "evals_new")
    print(f"Check: the new arms' re-evaluations in their own plans against their records, largest |difference| "
          f"over {n} losses: {worst:.2e}.\n")
    parts = split(recs, keys, where)
    report(parts, keys, (("tail+switch@0-1", "tail+switch"), ("snip+switch@0-1", "snip+switch"),
                         ("snip+switch@0-1", "tail+switch@0-1"), ("snip/run@0-1", "tail+switch@0-1")),
           counts({a: recs[a] for a in parts}, keys, where))


def where(arm: str) -> Path:
    """The folder of ``arm``'s evaluations."""
    return HERE / ("evals_new" if arm in NEW.values() else "evals_ref")


def main() -> None:
    checks()
    print("## What the runs spent (from their recorded plans)\n")
    print("| arm | runs | allocation at step 20 | FP4 share over the continuation | last plan's GEMMs in FP4 "
          "(fprop, dgrad, wgrad; mean over runs) | modelled GEMM time / BF16 (B200) |")
    print("|---|---|---|---|---|---|")
    schedule_and_time([(new_records(k), f"o{k}") for k in goal_1x.ORDERS], NEW, HERE / "plans")
    print()
    rho08.spent()
    runs = load()
    if not goal_1x.enough_orders(runs, NEW["snip+switch"]):
        return
    goal_1x.contrast_table(runs, (("tail+switch@0-1", "tail+switch"), ("snip+switch@0-1", "snip+switch"),
                                  ("snip+switch@0-1", "tail+switch@0-1"), ("snip/run@0-1", "snip"),
                                  ("snip/run@0-1", "tail+switch@0-1"), ("snip/run@0-1", "tail+switch"),
                                  ("snip/run@0-1", "snip+switch@0-1"), ("snip+switch@0-1", "snip"),
                                  ("tail+switch@0-1", "bf16"), ("snip+switch@0-1", "bf16"), ("snip/run@0-1", "bf16")),
                           "Contrasts A − B", median=True)
    goal_1x.recovered_table(runs, (*NEW.values(), "snip+switch", "tail+switch", "snip"))
    splits()


if __name__ == "__main__":
    main()
