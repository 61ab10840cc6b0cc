"""The forward/weights split of protocol_rep.md on the reported seeds: ``../goal_1x/``'s BF16, shipped
``snip``, ``tail+switch`` and ``snip+switch`` continuations of bases 1-4 at data orders 0 and 1, rerun
with their final checkpoints kept.

    python docs/results/forward_split/forward_split_rep.py > docs/results/forward_split/table_rep.md

Reads ``results_fsr_o<k>_plan.jsonl`` (BF16, ``snip``) and ``results_fsr_o<k>_run.jsonl`` (``tail+switch``,
``snip+switch``), and ``evals_rep/o<k>_<run>_{bf16,checkpoint,plan}.json`` as ``forward_split.py``
reads ``evals/``. The parts are ``forward_split.py``'s (a BF16 run's weights in BF16 are its recorded
loss: its own plan is BF16); each contrast's parts are decomposed as ``../replicas/replicas.py`` does
(the mean over the bases of each base's mean over its orders, SE over the bases with 3 df). Checks:
each rerun's recorded final losses against ``../goal_1x/``'s record of the same arm, base and order,
and at order 0 the re-evaluation in its own plan against the recorded final losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "replicas"))
sys.path.insert(0, str(HERE))
from forward_split import PARTS, evaluated, fprop_in_fp4  # one reading of the evaluation files
from replicas import DOMAINS, decompose

ORDERS = (0, 1)
BASES = (1, 2, 3, 4)
ARMS = {"bf16": "plan", "snip": "plan", "tail+switch": "run", "snip+switch": "run"}
CONTRASTS = (("snip", "tail+switch"), ("snip+switch", "tail+switch"), ("snip+switch", "snip"))
EVALS = HERE / "evals_rep"
GOAL_1X = HERE.parent / "goal_1x"


def records(prefix: str, where: Path, orders=ORDERS) -> dict[str, dict[tuple[int, int], dict]]:
    """arm -> {(base seed, order): its record} from ``where/results_<prefix>_o<k>_<kind>.jsonl``, finished runs."""
    out: dict[str, dict[tuple[int, int], dict]] = {arm: {} for arm in ARMS}
    for k in orders:
        for kind in ("plan", "run"):
            path = where / f"results_{prefix}_o{k}_{kind}.jsonl"
            for line in path.read_text().splitlines() if path.is_file() else []:
                r = json.loads(line)
                if r["policy"] in ARMS and ARMS[r["policy"]] == kind and r["status"] == "ok":
                    out[r["policy"]][(r["seed"], k)] = r
    return out


def main() -> None:
    recs = records("fsr", HERE)
    keys = sorted(key for key in {(b, k) for b in BASES for k in ORDERS} if all(key in recs[arm] for arm in ARMS))
    orders = sorted({k for _, k in keys})
    g1 = records("g1", GOAL_1X)
    final = {arm: {key: recs[arm][key]["final"] for key in keys} for arm in ARMS}
    repro = [abs(final[a][key][d] - g1[a][key]["final"][d]) for a in ARMS for key in keys if key in g1[a] for d in DOMAINS]
    bf16 = {arm: {key: final[arm][key] if arm == "bf16" else
                  evaluated(f"o{key[1]}_{recs[arm][key]['name']}", "bf16", EVALS) for key in keys} for arm in ARMS}
    own = [abs(evaluated(f"o0_{recs[a][key]['name']}", "checkpoint", EVALS)[d] - final[a][key][d])
           for a in ARMS if a != "bf16" for key in keys if key[1] == 0 for d in DOMAINS]
    print(f"(base, order) pairs with every arm finished: {len(keys)} (orders {', '.join(map(str, orders))}).\n")
    print(f"Checks: each rerun's final losses against ../goal_1x/'s record of the same run, largest |difference| "
          f"over {len(repro)} losses: {max(repro):.2e}; the order-0 re-evaluations in their own plan against the "
          f"recorded final losses, over {len(own)}: {max(own):.2e}.\n")
    split = {arm: {key: {d: {"gap": final[arm][key][d] - final["bf16"][key][d],
                             "forward": final[arm][key][d] - bf16[arm][key][d],
                             "weights": bf16[arm][key][d] - bf16["bf16"][key][d]} for d in DOMAINS} for key in keys}
             for arm in ARMS if arm != "bf16"}
    print("## Each arm − BF16, split (mean over the bases of their means over orders ± SE over the bases)\n")
    print("| arm | fprop GEMMs in FP4 at the end (per run) | domain | gap | forward part | weights part |")
    print("|---|---|---|---|---|---|")
    for arm, per in split.items():
        counts = ", ".join(f"{n}" for n, _ in (fprop_in_fp4(f"o{k}_{recs[arm][(b, k)]['name']}", EVALS) for b, k in keys))
        for d in DOMAINS:
            cells = [decompose({key: per[key][d][p] for key in keys}) for p in PARTS]
            print(f"| `{arm}` | {counts} of 32 | `{d}` | " + " | ".join(f"{c['mean']:+.4f} ± {c['se']:.4f}" for c in cells) + " |")
    print("\n## Contrasts A − B, split the same way\n")
    print("| A − B | domain | gap | forward part | weights part | pairs with A lower: gap; forward; weights |")
    print("|---|---|---|---|---|---|")
    for a, b in CONTRASTS:
        for d in DOMAINS:
            diff = {key: {p: split[a][key][d][p] - split[b][key][d][p] for p in PARTS} for key in keys}
            cells = [decompose({key: diff[key][p] for key in keys}) for p in PARTS]
            lower = "; ".join(f"{sum(diff[key][p] < 0 for key in keys)} of {len(keys)}" for p in PARTS)
            print(f"| `{a}` − `{b}` | `{d}` | " + " | ".join(f"{c['mean']:+.4f} ± {c['se']:.4f} ({c['mean'] / c['se']:+.1f} SE)"
                                                        for c in cells) + f" | {lower} |")
    print("\nPer (base, order), training domain (`val_loss`): gap; forward; weights of each contrast\n")
    print("| base | order | " + " | ".join(f"`{a}` − `{b}`" for a, b in CONTRASTS) + " |")
    print("|---|---|" + "---|" * len(CONTRASTS))
    for key in keys:
        print(f"| {key[0]} | {key[1]} | " + " | ".join(", ".join(
            f"{split[a][key]['val_loss'][p] - split[b][key]['val_loss'][p]:+.4f}" for p in PARTS) for a, b in CONTRASTS) + " |")


if __name__ == "__main__":
    main()
