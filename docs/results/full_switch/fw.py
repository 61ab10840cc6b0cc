"""protocol.md: ``tail+switch`` and ``snip+switch`` with the run budget's share grid topped at 1.0 (arms
``tail+switch@1``, ``snip+switch@1``) on the reported seeds' 1.66M bases 1-4 × data orders 0-3, against
``../goal_1x/``'s BF16, uniform ``fp4_block``, shipped ``snip``, ``tail+switch`` and ``snip+switch`` (grid top
0.95) of the same bases and orders.

    python docs/results/full_switch/fw.py > docs/results/full_switch/table.md

Reads ``results_fw_o<k>.jsonl`` (both new arms), ``results_fwc.jsonl`` (the check: this commit's
``snip+switch`` at the default grid on bases 1-2, order 0, against goal_1x's record), goal_1x's records,
``plans/o<k>_<run>_step_<N>.json`` (every plan of every new run; the check runs' as
``plans/check_<run>_step_<N>.json``: the schedule and the modelled GEMM time) and for the split ``evals_fw/o<k>_<run>_{checkpoint,bf16,plan}.json`` with
``../forward_split/``'s reported-seed reruns and ``evals_rep/`` (orders 0-1). Contrasts, their
decomposition and reading are goal.py's and replicas.py's, the recovered share goal_1x.py's and the split
forward_split.py's (imported: one place); the modelled time is the comparison report's.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
ROOT = RESULTS.parent.parent
for folder in ("replicas", "goal_replicas", "goal_1x", "forward_split"):
    sys.path.insert(0, str(RESULTS / folder))
sys.path.insert(0, str(ROOT))
import goal_1x  # the goal test at 1.66M: its records, arms and recovered share
from forward_split import counts, own_plan_check, records, report, split, whole

from experiments.comparison.report import blackwell_costs, modeled_time_ratio
from megatron_snip.config.toml_io import config_from_dict
from megatron_snip.precision.formats import FP4_FORMATS

ORDERS = range(4)
NEW = {"tail+switch": "tail+switch@1", "snip+switch": "snip+switch@1"}  # policy -> arm
SPLIT_ORDERS = (0, 1)
FS = RESULTS / "forward_split"
PLANS = HERE / "plans"


def load() -> goal_1x.Runs:
    """goal_1x's arms and the new ones, orders every arm finished on every base."""
    runs = {arm: goal_1x.arm_runs(arm, lambda k, arm=arm: goal_1x.records_path(arm, k)) for arm in goal_1x.ARMS}
    for policy, arm in NEW.items():
        runs[arm] = goal_1x.arm_runs(policy, lambda k: HERE / f"results_fw_o{k}.jsonl")
    return goal_1x.whole_orders(runs)


def run_plans(prefix: str, record: dict, folder: Path = PLANS) -> list[tuple[int, Path]]:
    """(start step, plan file) of every plan one run recorded (``<folder>/<prefix>_<run>_step_<N>.json``), in step order."""
    files = sorted(folder.glob(f"{prefix}_{record['name']}_step_*.json"))
    return [(int(f.stem.rsplit("_", 1)[1]), f) for f in files]


def modelled_time(plans: list[tuple[int, Path]], record: dict) -> float:
    """Modelled linear-GEMM time of one run over the same GEMMs in BF16 at B200's ratios (the comparison
    report's ``blackwell_costs``): each of its ``plans`` ((start step, file), in step order) weighted by the
    steps it ran, BF16 warm-up included."""
    cfg = config_from_dict(record["config"])
    costs = blackwell_costs(record["formats"])
    ends = [s for s, _ in plans[1:]] + [record["steps"]]
    return sum((b - a) * modeled_time_ratio(p, cfg, costs) for (a, p), b in zip(plans, ends)) / record["steps"]


def schedule_and_time(sources: list[tuple[Path, str]], label: dict[str, str], folder: Path = PLANS) -> None:
    """A table row per arm: the allocation its first policy plan recorded, each interval's FP4 share as run, the last
    plan's GEMMs in FP4 by kind, and the modelled linear-GEMM time over the continuation at B200's ratios
    (``modelled_time``). ``sources``: (results.jsonl, the prefix of its runs' plan files in ``folder``)."""
    for policy, arm in label.items():
        recs = [(prefix, r) for path, prefix in sources for line in (path.read_text().splitlines() if path.is_file() else [])
                if (r := json.loads(line))["policy"] == policy and r["status"] == "ok"]
        if not recs:
            continue
        schedules, times, kinds, per_kind = Counter(), [], Counter(), 0
        for prefix, r in recs:
            plans = run_plans(prefix, r, folder)
            first = json.loads(plans[1][1].read_text())["extra"]
            schedules[first.get("budget_schedule", "plan budget: the target share in every plan")] += 1
            times.append(modelled_time(plans, r))
            last = json.loads(plans[-1][1].read_text())["entries"]
            kinds.update(g.rsplit(".", 1)[1] for g, f in last.items() if f in FP4_FORMATS)
            per_kind = sum(g.endswith(".fprop") for g in last)
        n = len(recs)
        shares = sorted({f"{r['fp4_share_mean']:.4f}" for _, r in recs})
        print(f"| `{arm}` | {n} | " + "; ".join(f"`{s}` ({c})" for s, c in schedules.most_common()) + f" | {', '.join(shares)} | "
              + ", ".join(f"{kinds[g] / n:.1f}" for g in ("fprop", "dgrad", "wgrad"))
              + f" of {per_kind} each | {min(times):.4f}-{max(times):.4f} |")


def main() -> None:
    goal_1x.check_against_records("this commit's `snip+switch` at the default share grid", HERE / "results_fwc.jsonl",
                                  "snip+switch")
    print("## What the runs spent (from their recorded plans)\n")
    print("| arm | runs | allocation at step 20 | FP4 share over the continuation | last plan's GEMMs in FP4 "
          "(fprop, dgrad, wgrad; mean over runs) | modelled GEMM time / BF16 (B200) |")
    print("|---|---|---|---|---|---|")
    schedule_and_time([(HERE / "results_fwc.jsonl", "check")], {"snip+switch": "snip+switch (check, grid top 0.95)"})
    schedule_and_time([(HERE / f"results_fw_o{k}.jsonl", f"o{k}") for k in ORDERS], NEW)
    print()
    runs = load()
    if not goal_1x.enough_orders(runs, NEW["snip+switch"]):
        return
    goal_1x.contrast_table(runs, (("snip+switch@1", "snip+switch"), ("tail+switch@1", "tail+switch"),
                                  ("snip+switch@1", "tail+switch@1"), ("snip+switch@1", "tail+switch"),
                                  ("snip+switch@1", "snip"), ("tail+switch@1", "snip"),
                                  ("snip+switch@1", "uniform:fp4_block"), ("snip+switch@1", "bf16"),
                                  ("tail+switch@1", "bf16")), "Contrasts A − B", median=True)
    goal_1x.recovered_table(runs, (*NEW.values(), "snip+switch", "tail+switch", "snip"))

    print("\n## The split at orders 0-1 (forward_split's definitions; references: its reported-seed reruns)\n")
    sources = [(FS / f"results_fsr_o{k}_{kind}.jsonl", k) for k in SPLIT_ORDERS for kind in ("plan", "run")]
    recs = records(sources, {p: p for p in ("bf16", "tail+switch", "snip+switch")})
    recs |= records([(HERE / f"results_fw_o{k}.jsonl", k) for k in SPLIT_ORDERS], NEW)
    keys = whole(recs, [(b, k) for b in goal_1x.BASES for k in SPLIT_ORDERS])
    if not keys:
        print("No (base, order) with every arm's evaluations: no split.")
        return

    def where(arm: str) -> Path:
        return HERE / "evals_fw" if arm in NEW.values() else FS / "evals_rep"

    n, worst = own_plan_check({a: recs[a] for a in NEW.values()}, keys, HERE / "evals_fw")
    print(f"Check: the new arms' re-evaluations in their own plans against their records, largest |difference| "
          f"over {n} losses: {worst:.2e}.\n")
    parts = split(recs, keys, where)
    report(parts, keys, (("snip+switch@1", "snip+switch"), ("tail+switch@1", "tail+switch"),
                         ("snip+switch@1", "tail+switch@1")), counts({a: recs[a] for a in parts}, keys, where))


if __name__ == "__main__":
    main()
