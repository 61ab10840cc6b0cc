"""protocol.md: shipped ``snip`` with ``snip.forward_stickiness`` = 1 (``kept1``) and 0.5 (``kept05``) on the
development bases 11-14 (order 0), split as ``../forward_split/forward_split.py`` splits, against that
study's shipped ``snip`` and ``tail+switch`` on the same bases; first the check that this commit's shipped
``snip`` reproduces forward_split's records.

    python docs/results/kept_forward/dev.py > docs/results/kept_forward/table_dev.md

Reads ``results_kfc_plan.jsonl`` (the check), ``results_kf1_plan.jsonl`` and ``results_kf05_plan.jsonl`` with
``evals_kf1/`` and ``evals_kf05/`` (``o0_<run>_{checkpoint,bf16,plan}.json``), and forward_split's records and
``evals/`` for the references; for the forward GEMMs each re-plan changed, every plan of these runs and of
forward_split's shipped ``snip``: ``plans/<arm>_o0_<run>_step_<N>.json``.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
FS = HERE.parent / "forward_split"
sys.path.insert(0, str(FS))
from forward_split import BASES, counts, own_plan_check, records, report, split, whole  # one split

REFERENCES = {p: p for p in ("bf16", "snip", "tail+switch")}
KEPT = {"kept1": "kf1", "kept05": "kf05"}  # arm -> out-dir tag


def check() -> None:
    """Every recorded final loss, final plan and FP4 share of this commit's shipped ``snip`` on bases 11-12
    against forward_split's."""
    ref = records([(FS / "results_fs_plan.jsonl", 0)], {"snip": "snip"})["snip"]
    now = records([(HERE / "results_kfc_plan.jsonl", 0)], {"snip": "snip"})["snip"]
    fields = ("final", "final_plan", "fp4_share", "fp4_share_mean")
    same = all(now[key][f] == ref[key][f] for key in now for f in fields)
    losses = sum(len(now[key]["final"]) for key in now)
    print(f"Check: this commit's shipped `snip` on bases {', '.join(str(b) for b, _ in sorted(now))} against "
          f"forward_split's ({losses} final losses, final plans, FP4 shares): "
          f"{'identical' if same and now else 'DIFFERENT'}.\n")


def churn(arm: str) -> str:
    """Forward GEMMs whose format a re-plan changed, per run (base order) and re-plan, of 32."""
    out = []
    for base in BASES:
        plans = [json.loads(p.read_text())["entries"] for p in
                 sorted((HERE / "plans").glob(f"{arm}_o0_snip_fp8_block-fp4_block_rho0.9_seed{base}_step_*.json"))]
        out.append("/".join(str(sum(a[g] != b[g] for g in a if g.endswith(".fprop"))) for a, b in itertools.pairwise(plans)))
    return ", ".join(out)


def probe(arms: Mapping[str, tuple[Path, Path]]) -> None:
    """Split and tabulate each probe arm (arm -> (its results.jsonl, its evaluations folder); its policy is
    ``snip``) against forward_split's development references, after the own-plan check of each."""
    recs = records([(FS / "results_fs_plan.jsonl", 0), (FS / "results_fs_run.jsonl", 0)], REFERENCES)
    for arm, (results, _) in arms.items():
        recs |= records([(results, 0)], {"snip": arm})
    keys = whole(recs, [(b, 0) for b in BASES])

    def where(arm: str) -> Path:
        return arms[arm][1] if arm in arms else FS / "evals"

    for arm in arms:
        n, worst = own_plan_check({arm: recs[arm]}, keys, where(arm))
        print(f"Check: `{arm}`'s re-evaluations in its own plan against its recorded final losses, largest "
              f"|difference| over {n} losses: {worst:.2e}.\n")
    print(f"Bases with every arm finished: {', '.join(str(b) for b, _ in keys)} (order 0). FP4 share over the "
          "continuation (every run of the arm): " + "; ".join(
              f"`{a}` " + ", ".join(sorted({f"{per[key]['fp4_share_mean']:.4f}" for key in keys})) for a, per in recs.items()
              if a != "bf16") + ".\n")
    parts = split(recs, keys, where)
    contrasts = [(arm, ref) for arm in arms for ref in ("snip", "tail+switch")]
    report(parts, keys, contrasts, counts({a: recs[a] for a in parts}, keys, where))


def main() -> None:
    check()
    print("Forward GEMMs changed per re-plan (of 32; the two re-plans after the first, per base): "
          + "; ".join(f"`{arm}` {churn(arm)}" for arm in ("snip", *KEPT)) + ".\n")
    probe({arm: (HERE / f"results_{tag}_plan.jsonl", HERE / f"evals_{tag}") for arm, tag in KEPT.items()})


if __name__ == "__main__":
    main()
