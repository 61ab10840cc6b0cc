"""protocol.md: at 6.46M, ρ = 0.9, on development bases trained in each sitting (11-12, then 13-14), ``snip``
with the run budget over the whole share range (arm ``snip/run@0-1``: ``snip.budget = "run"``,
``snip.budget_share_range = [0.0, 1.0]``) against shipped ``snip`` (plan budget) and NVIDIA's ``tail+switch``
(run budget, default grid), at data orders 0 and 1.

    python docs/results/own_curve_dev/oc.py > docs/results/own_curve_dev/table.md

Reads ``results_<kind>_o<k>.jsonl`` (kind ``ocp``: ``snip``, ``ocr``: ``tail+switch``, ``oc``: the new arm)
and ``plans/<kind>_o<k>_<run>_step_<N>.json`` (every plan of every run: the schedule and the modelled GEMM
time). A (base, order) counts when its three arms finished from one training of the base (its base record
the same in their files). The contrasts and their reading are goal.py's (through goal_1x.py's table), the spent table
full_switch/fw.py's, and goal_dev.py's records of the earlier bases are set beside (imported: one place each).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
for folder in ("replicas", "goal_replicas", "goal_1x", "goal_dev", "full_switch"):
    sys.path.insert(0, str(RESULTS / folder))
import goal_1x  # the contrast table
import goal_dev  # the records of the development bases trained on an earlier machine
from fw import schedule_and_time
from replicas import DOMAINS, finals

ARM = "snip/run@0-1"
ORDERS = (0, 1)
BASES = (11, 12, 13, 14)
KINDS = {"snip": ("ocp", "snip"), "tail+switch": ("ocr", "tail+switch"), ARM: ("oc", "snip")}  # arm -> (out-dir kind, policy)
CONTRASTS = ((ARM, "snip"), (ARM, "tail+switch"), ("snip", "tail+switch"))
PRECONDITIONER = RESULTS / "preconditioner/results_pc4_plan.jsonl"


def records(kind: str, order: int) -> Path:
    return HERE / f"results_{kind}_o{order}.jsonl"


def all_runs() -> goal_1x.Runs:
    """arm -> {(base seed, order): final losses} of every finished run."""
    return {arm: {(seed, k): final for k in ORDERS for seed, final in finals(records(kind, k), policy).items()}
            for arm, (kind, policy) in KINDS.items()}


def counted(runs: goal_1x.Runs) -> list[tuple[int, int]]:
    """The (base, order) pairs where all three arms finished from one training of the base (its record the
    same in the files of order 0's ``snip``, where it was trained, and of the order's three arms)."""
    bases = {(kind, k): finals(records(kind, k), "base") for kind, _ in KINDS.values() for k in ORDERS}
    trained = bases[("ocp", 0)]
    return [(b, k) for b in BASES if b in trained for k in ORDERS
            if all((b, k) in per for per in runs.values())
            and all(bases[(kind, k)].get(b) == trained[b] for kind, _ in KINDS.values())]


def bases_against_records() -> None:
    """Each base (and order 0's shipped ``snip``) trained here minus the preconditioner study's record of it
    (the records of this study's fixed commit name no machine: ``machine`` came with d949d82)."""
    print("| run | " + " | ".join(f"`{d}`: here − record" for d in DOMAINS) + " |")
    print("|---|" + "---|" * len(DOMAINS))
    for policy in ("base", "snip"):
        here, there = finals(records("ocp", 0), policy), finals(PRECONDITIONER, policy)
        for seed in sorted(here):
            print(f"| `{policy}`, seed {seed} | " + " | ".join(f"{here[seed][d] - there[seed][d]:+.4f}" for d in DOMAINS) + " |")
    print()


def main() -> None:
    print("## This machine's bases against their records\n")
    bases_against_records()
    print("## What the runs spent (from their recorded plans)\n")
    print("| arm | runs | allocation at step 20 | FP4 share over the continuation | last plan's GEMMs in FP4 "
          "(fprop, dgrad, wgrad; mean over runs) | modelled GEMM time / BF16 (B200) |")
    print("|---|---|---|---|---|---|")
    for arm, (kind, policy) in KINDS.items():
        schedule_and_time([(records(kind, k), f"{kind}_o{k}") for k in ORDERS], {policy: arm}, HERE / "plans")
    runs = all_runs()
    pairs = counted(runs)
    bases = sorted({b for b, _ in pairs})
    missing = [(arm, b, k) for arm, per in runs.items() for b in BASES for k in ORDERS if (b, k) not in per]
    print(f"\n(base, order) pairs counted: {', '.join(map(str, pairs)) or 'none'}; runs missing (arm, base, order): "
          + (", ".join(map(str, missing)) or "none") + ".\n")
    if not pairs:
        print("No (base, order) with all three arms: nothing to compare.")
        return
    if len(bases) < len(BASES):
        print(f"**Interim** (protocol.md): the claims are made on four bases; this reading ({len(bases)} bases, "
              f"SE with {len(bases) - 1} df) decides nothing.\n")
    goal_1x.contrast_table({arm: {key: v for key, v in per.items() if key in pairs} for arm, per in runs.items()},
                           CONTRASTS, "Contrasts A − B, this machine's bases", median=True)
    earlier = {arm: {key: v for key, v in per.items() if key in pairs}
               for arm, per in goal_dev.load().items() if arm in KINDS}
    print()
    goal_1x.contrast_table(earlier, (("snip", "tail+switch"),), "Beside it: goal_dev's records of the same seeds "
                           "and orders, bases trained on an earlier machine", median=True)


if __name__ == "__main__":
    main()
