"""protocol.md: at 6.46M, ρ = 0.9, ``snip`` with the run budget over the whole share range (arm
``snip/run@0-1``: ``snip.budget = "run"``, ``snip.budget_share_range = [0.0, 1.0]``) on the development bases
11-14 × data orders 0-4, against ``../goal_dev/``'s recorded shipped ``snip``, ``tail+switch`` and
``snip+switch`` of the same bases and orders, and the preconditioner study's BF16 at order 0.

    python docs/results/own_curve_dev/oc.py > docs/results/own_curve_dev/table.md

Reads ``results_check.jsonl`` (this commit's bases and shipped ``snip`` at order 0, against
``../preconditioner/results_pc4_plan.jsonl``), ``results_oc_o<k>.jsonl`` (the new arm; a base counts when
its five orders finished) and ``plans/o<k>_<run>_step_<N>.json`` (every plan of every new run: the schedule and
the modelled GEMM time). The references are goal_dev.py's, the contrasts and their reading goal.py's (through
goal_1x.py's table) and the spent table full_switch/fw.py's (imported: one place each).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
for folder in ("replicas", "goal_replicas", "goal_1x", "goal_dev", "full_switch"):
    sys.path.insert(0, str(RESULTS / folder))
import goal_1x  # the contrast table and the record check
import goal_dev  # the development bases' references at orders 0-4
from fw import schedule_and_time
from replicas import finals

ARM = "snip/run@0-1"
PRECONDITIONER = RESULTS / "preconditioner/results_pc4_plan.jsonl"
CONTRASTS = ((ARM, "snip"), (ARM, "tail+switch"), (ARM, "snip+switch"), ("snip", "tail+switch"), (ARM, "bf16"))


def new_records(order: int) -> Path:
    return HERE / f"results_oc_o{order}.jsonl"


def checks() -> None:
    """This commit against the records: the bases of every sitting (in each out-dir's records) and shipped ``snip``."""
    for name, path in [("the check's", HERE / "results_check.jsonl")] + [
            (f"order {k}'s", new_records(k)) for k in goal_dev.ORDERS if new_records(k).is_file()]:
        goal_1x.check_against_records(f"this commit's 4,000-step BF16 bases ({name} out-dir)", path, "base",
                                      reference=PRECONDITIONER)
    goal_1x.check_against_records("this commit's shipped `snip`", HERE / "results_check.jsonl", "snip",
                                  reference=PRECONDITIONER)


def new_runs() -> dict[tuple[int, int], dict[str, float]]:
    """{(base seed, order): final losses} of the new arm's finished runs."""
    return {(seed, k): final for k in goal_dev.ORDERS for seed, final in finals(new_records(k), "snip").items()}


def load(new: dict[tuple[int, int], dict[str, float]]) -> goal_1x.Runs:
    """The references and the new arm (``new``) on the bases whose five orders it finished; BF16 at order 0."""
    done = [b for b in goal_dev.BASES if all((b, k) in new for k in goal_dev.ORDERS)]
    runs = {arm: {key: v for key, v in per.items() if key[0] in done} for arm, per in goal_dev.load().items()}
    runs[ARM] = {key: v for key, v in new.items() if key[0] in done}
    runs["bf16"] = {(seed, 0): final for seed, final in finals(PRECONDITIONER, "bf16").items() if seed in done}
    return runs


def main() -> None:
    checks()
    print("## What the new runs spent (from their recorded plans)\n")
    print("| arm | runs | allocation at step 20 | FP4 share over the continuation | last plan's GEMMs in FP4 "
          "(fprop, dgrad, wgrad; mean over runs) | modelled GEMM time / BF16 (B200) |")
    print("|---|---|---|---|---|---|")
    schedule_and_time([(new_records(k), f"o{k}") for k in goal_dev.ORDERS], {"snip": ARM}, HERE / "plans")
    new = new_runs()
    runs = load(new)
    bases = sorted({b for b, _ in runs[ARM]})
    missing = [(b, k) for b in goal_dev.BASES for k in goal_dev.ORDERS if (b, k) not in new]
    print(f"\nBases with all five orders of `{ARM}`: {bases} (of {list(goal_dev.BASES)}); runs missing (base, order): "
          + (", ".join(map(str, missing)) or "none") + ".\n")
    if not bases:
        print("No base has all five orders: nothing to compare.")
        return
    if len(bases) < len(goal_dev.BASES):
        print(f"**Interim** (protocol.md): the claims are made on all four bases; this reading ({len(bases)} bases, "
              f"SE with {len(bases) - 1} df) decides nothing.\n")
    goal_1x.contrast_table(runs, CONTRASTS, "Contrasts A − B (against BF16: order 0 only)", median=True)


if __name__ == "__main__":
    main()
