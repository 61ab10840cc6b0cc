"""Where each plan's gap to BF16 lies at 1.66M (protocol.md): the evaluated plan's own forward pass, or
the weights it trained.

    python docs/results/forward_split/forward_split.py > docs/results/forward_split/table.md

Reads the committed records beside it: ``results_fs_plan.jsonl`` (BF16, uniform ``fp4_block``, shipped
``snip``) and ``results_fs_run.jsonl`` (``tail+switch``, ``snip+switch``, run budget), and for each
continuation ``evals/<run>_checkpoint.json`` and ``evals/<run>_bf16.json`` (``megatron_snip.evaluate``
on its final checkpoint, in its own plan and with every GEMM in BF16) and ``evals/<run>_plan.json``
(the plan in force at the end). Per base b and domain, with L the recorded final loss, E the loss of
the same weights evaluated in BF16 and B the base's BF16 continuation:

    gap = L(arm) − L(BF16 run),  forward part = L(arm) − E(arm),  weights part = E(arm) − E(BF16 run)

(gap = forward + weights exactly when E(BF16 run) = L(BF16 run), which the check shows). Mean ± SE over
the 4 bases (3 df), and the same split of the contrasts arm A − arm B.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "replicas"))
from replicas import DOMAINS  # one list of domains for every study

BASES = (11, 12, 13, 14)
ARMS = {"bf16": "plan", "uniform:fp4_block": "plan", "snip": "plan", "tail+switch": "run", "snip+switch": "run"}
CONTRASTS = (("snip", "tail+switch"), ("snip+switch", "tail+switch"), ("snip+switch", "snip"))
EVAL_KEY = {"valid": "val_loss", "moby_dick": "val_loss_moby_dick", "python_docs": "val_loss_python_docs"}
PARTS = ("gap", "forward", "weights")


def records() -> dict[str, dict[int, dict]]:
    """arm -> {base seed: its record}, finished runs only."""
    out: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for kind in ("plan", "run"):
        for line in (HERE / f"results_fs_{kind}.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["policy"] in ARMS and ARMS[r["policy"]] == kind and r["status"] == "ok":
                out[r["policy"]][r["seed"]] = r
    return out


def evaluated(name: str, plan: str, where: Path = HERE / "evals") -> dict[str, float]:
    """{domain: loss} of one re-evaluation of run ``name``'s final checkpoint (``where/<name>_<plan>.json``)."""
    doms = json.loads((where / f"{name}_{plan}.json").read_text())["domains"]
    return {EVAL_KEY[k]: v["loss"] for k, v in doms.items()}


def fprop_in_fp4(name: str, where: Path = HERE / "evals") -> tuple[int, int]:
    """(fprop GEMMs in FP4, fprop GEMMs) in the plan in force at the end of run ``name``."""
    entries = json.loads((where / f"{name}_plan.json").read_text())["entries"]
    fprops = [f for gemm, f in entries.items() if gemm.endswith(".fprop")]
    return sum(f.startswith("fp4") or f == "nvfp4" for f in fprops), len(fprops)


def mean_se(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):+.4f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.4f}"


def main() -> None:
    recs = records()
    bases = [b for b in BASES if all(b in recs[arm] for arm in ARMS)]
    final = {arm: {b: recs[arm][b]["final"] for b in bases} for arm in ARMS}
    own = {arm: {b: evaluated(recs[arm][b]["name"], "checkpoint") for b in bases} for arm in ARMS}
    bf16 = {arm: {b: evaluated(recs[arm][b]["name"], "bf16") for b in bases} for arm in ARMS}
    worst = max(abs(own[a][b][d] - final[a][b][d]) for a in ARMS for b in bases for d in DOMAINS)
    print(f"Bases with every arm finished: {', '.join(map(str, bases))}.\n")
    print(f"Check: the re-evaluation in each run's own plan against its recorded final loss, largest |difference| "
          f"over every run and domain: {worst:.2e}.\n")
    split = {arm: {b: {d: {"gap": final[arm][b][d] - final["bf16"][b][d],
                           "forward": final[arm][b][d] - bf16[arm][b][d],
                           "weights": bf16[arm][b][d] - bf16["bf16"][b][d]} for d in DOMAINS} for b in bases}
             for arm in ARMS if arm != "bf16"}
    print("## Each arm − BF16, split (mean ± SE over the bases)\n")
    print("| arm | fprop GEMMs in FP4 at the end | domain | gap | forward part: own plan − BF16, same weights "
          "| weights part: the weights in BF16 − BF16 run |")
    print("|---|---|---|---|---|---|")
    for arm, per in split.items():
        counts = [fprop_in_fp4(recs[arm][b]["name"]) for b in bases]
        fp = ", ".join(f"{n}/{t}" for n, t in counts)
        for d in DOMAINS:
            print(f"| `{arm}` | {fp} | `{d}` | " + " | ".join(mean_se([per[b][d][p] for b in bases]) for p in PARTS) + " |")
    print("\n## Contrasts A − B, split the same way (mean ± SE over the bases)\n")
    print("| A − B | domain | gap | forward part | weights part | per base (gap; forward; weights) |")
    print("|---|---|---|---|---|---|")
    for a, b_arm in CONTRASTS:
        for d in DOMAINS:
            diff = {b: {p: split[a][b][d][p] - split[b_arm][b][d][p] for p in PARTS} for b in bases}
            per_base = "; ".join(f"{b}: " + ", ".join(f"{diff[b][p]:+.4f}" for p in PARTS) for b in bases)
            print(f"| `{a}` − `{b_arm}` | `{d}` | " + " | ".join(mean_se([diff[b][p] for b in bases]) for p in PARTS)
                  + f" | {per_base} |")


if __name__ == "__main__":
    main()
