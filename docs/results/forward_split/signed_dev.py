"""protocol_signed.md: shipped ``snip`` with ``snip.loss_first_order = "signed"`` on the development bases
11-14 (order 0), split as ``forward_split.py`` splits, against that study's shipped ``snip`` and
``tail+switch`` on the same bases (the same code).

    python docs/results/forward_split/signed_dev.py > docs/results/forward_split/table_signed.md

Reads ``results_fss_plan.jsonl`` and ``evals_signed/`` (the signed arm, named ``signed``), and
forward_split's own records and ``evals/`` for the references.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from forward_split import BASES, counts, own_plan_check, records, report, split, whole  # one split

SIGNED = HERE / "evals_signed"
REFERENCES = {p: p for p in ("bf16", "snip", "tail+switch")}


def main() -> None:
    recs = records([(HERE / "results_fs_plan.jsonl", 0), (HERE / "results_fs_run.jsonl", 0)], REFERENCES)
    recs |= records([(HERE / "results_fss_plan.jsonl", 0)], {"snip": "signed"})
    keys = whole(recs, [(b, 0) for b in BASES])
    n, worst = own_plan_check({"signed": recs["signed"]}, keys, SIGNED)
    print(f"Bases: {', '.join(str(b) for b, _ in keys)}. Check: the signed arm's re-evaluations in their own plan "
          f"against the recorded final losses, largest |difference| over {n} losses: {worst:.2e}.\n")

    def where(arm: str) -> Path:
        return SIGNED if arm == "signed" else HERE / "evals"

    parts = split(recs, keys, where)
    report(parts, keys, (("signed", "snip"), ("signed", "tail+switch")), counts({a: recs[a] for a in parts}, keys, where))


if __name__ == "__main__":
    main()
