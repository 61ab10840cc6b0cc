"""protocol_rep.md: shipped ``snip`` with the development probe's chosen ``snip.forward_depth_prior`` (arm
``depth``) on the reported seeds' 1.66M bases 1-4 × data orders 0-3, against ``../goal_1x/``'s BF16, uniform
``fp4_block``, shipped ``snip``, ``tail+switch`` and ``snip+switch`` of the same bases and orders.

    python docs/results/depth_prior/rep.py > docs/results/depth_prior/table_rep.md

Reads ``results_dr_o<k>.jsonl`` (the depth arm), ``results_drc.jsonl`` (the check: this commit's
``tail+switch`` on bases 1-2, order 0, against goal_1x's record), goal_1x's records, and for the split
``evals_dr/o<k>_<run>_{checkpoint,bf16,plan}.json`` with ``../forward_split/``'s reported-seed records and
``evals_rep/`` (orders 0-1). Contrasts, their decomposition and their reading are goal.py's and
replicas.py's (imported: one place); the recovered share is goal_1x.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
for folder in ("replicas", "goal_replicas", "goal_1x", "forward_split"):
    sys.path.insert(0, str(RESULTS / folder))
import goal_1x  # the goal test at 1.66M: its records, arms and recovered share
from forward_split import counts, own_plan_check, records, report, split, whole

ORDERS = range(4)
ARM = "depth"
SPLIT_ORDERS = (0, 1)
FS = RESULTS / "forward_split"


def load() -> goal_1x.Runs:
    """goal_1x's arms and ``depth``, orders every arm finished on every base."""
    runs = {arm: goal_1x.arm_runs(arm, lambda k, arm=arm: goal_1x.records_path(arm, k)) for arm in goal_1x.ARMS}
    runs[ARM] = goal_1x.arm_runs("snip", lambda k: HERE / f"results_dr_o{k}.jsonl")
    return goal_1x.whole_orders(runs)


def main() -> None:
    goal_1x.check_against_records("this commit's `tail+switch`", HERE / "results_drc.jsonl", "tail+switch")
    runs = load()
    orders = sorted({k for _, k in runs[ARM]})
    print(f"Whole orders: {orders} (of {list(ORDERS)}); every arm's runs: "
          + ", ".join(f"`{a}` {len(v)}" for a, v in runs.items()) + ".\n")
    if len(orders) < 2:
        print("Fewer than two whole orders: no claim (protocol_rep.md).")
        return
    goal_1x.contrast_table(runs, [(ARM, b) for b in ("tail+switch", "snip", "snip+switch", "uniform:fp4_block", "bf16")],
                           f"`{ARM}` − each arm")
    goal_1x.recovered_table(runs, (ARM, "snip", "tail+switch", "snip+switch"))

    print("\n## The split at orders 0-1 (forward_split's definitions; references: its reported-seed reruns)\n")
    sources = [(FS / f"results_fsr_o{k}_{kind}.jsonl", k) for k in SPLIT_ORDERS for kind in ("plan", "run")]
    recs = records(sources, {p: p for p in ("bf16", "snip", "tail+switch")})
    recs |= records([(HERE / f"results_dr_o{k}.jsonl", k) for k in SPLIT_ORDERS], {"snip": ARM})
    keys = whole(recs, [(b, k) for b in goal_1x.BASES for k in SPLIT_ORDERS])
    print("FP4 share over the continuation (every run of the arm, orders 0-1): " + "; ".join(
        f"`{a}` " + ", ".join(sorted({f"{per[key]['fp4_share_mean']:.4f}" for key in keys})) for a, per in recs.items()
        if a != "bf16") + ".\n")

    def where(arm: str) -> Path:
        return HERE / "evals_dr" if arm == ARM else FS / "evals_rep"

    n, worst = own_plan_check({ARM: recs[ARM]}, keys, where(ARM))
    print(f"Check: `{ARM}`'s re-evaluations in its own plan against its records, largest |difference| over "
          f"{n} losses: {worst:.2e}.\n")
    parts = split(recs, keys, where)
    report(parts, keys, ((ARM, "tail+switch"), (ARM, "snip")), counts({a: recs[a] for a in parts}, keys, where))


if __name__ == "__main__":
    main()
