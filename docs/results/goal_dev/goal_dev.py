"""The goal test's replication on the development bases 11-14, and all eight bases together (protocol.md).

    python docs/results/goal_dev/goal_dev.py > docs/results/goal_dev/table.md

Records: ``snip+switch`` at every order and the three arms at orders 3-4 are this folder's
``results_gd4_o<k>_{plan,run}.jsonl``; ``snip`` and ``tail+switch`` at orders 1-2 are
``../replicas/results_rp4_o<k>_{plan,run}.jsonl``, ``tail+switch`` at order 0 ``../replicas/results_rp4_o0_run.jsonl``
and ``snip`` at order 0 ``../preconditioner/results_pc4_plan.jsonl``. An order counts only when all three
arms finished on all four bases (the protocol's whole orders). The contrasts, their decomposition and
their reading are ``../goal_replicas/goal.py``'s; the eight-base figures pool each base's mean over its
own orders (6 for bases 1-4, those counted here for 11-14), SE over the 8 base means.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "goal_replicas"))
import goal  # the goal test's contrasts and reading, one place for both

BASES = (11, 12, 13, 14)
ORDERS = range(5)


def records_path(arm: str, order: int) -> Path:
    """Where ``arm``'s records of one order on the development bases are (module docstring)."""
    kind = goal.ARMS[arm][1]
    if arm == "snip+switch" or order >= 3:
        return HERE / f"results_gd4_o{order}_{kind}.jsonl"
    if (arm, order) == ("snip", 0):
        return HERE.parent / "preconditioner/results_pc4_plan.jsonl"
    return HERE.parent / f"replicas/results_rp4_o{order}_{kind}.jsonl"


def load() -> dict[str, dict[tuple[int, int], dict[str, float]]]:
    """arm -> {(base seed, order): final losses} over the whole orders only."""
    runs = {arm: {(seed, k): final for k in ORDERS for seed, final in goal.finals(records_path(arm, k), policy).items()
                  if seed in BASES}
            for arm, (policy, _) in goal.ARMS.items()}
    whole = [k for k in ORDERS if all((b, k) in runs[arm] for arm in runs for b in BASES)]
    return {arm: {key: v for key, v in per.items() if key[1] in whole} for arm, per in runs.items()}


def main() -> None:
    dev = load()
    orders = sorted({k for _, k in dev["snip"]})
    print(f"# Development bases {BASES[0]}-{BASES[-1]}, whole orders {orders}\n")
    goal.report(dev)
    print("# All eight bases: 1-4 (orders 0-5) and 11-14\n")
    reported = goal.load()
    goal.report({arm: {**reported[arm], **dev[arm]} for arm in goal.ARMS})


if __name__ == "__main__":
    main()
