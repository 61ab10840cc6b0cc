"""protocol_signed.md: shipped ``snip`` with ``snip.loss_first_order = "signed"`` on the development bases
11-14 (order 0), split as ``forward_split.py`` splits, against that study's shipped ``snip`` and
``tail+switch`` on the same bases (the same code).

    python docs/results/forward_split/signed_dev.py > docs/results/forward_split/table_signed.md

Reads ``results_fss_plan.jsonl`` and ``evals_signed/<run>_{checkpoint,bf16,plan}.json``, and
forward_split's own records for the references.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "replicas"))
sys.path.insert(0, str(HERE))
from forward_split import BASES, PARTS, evaluated, fprop_in_fp4, mean_se, records  # one reading of the files
from replicas import DOMAINS

SIGNED = HERE / "evals_signed"


def signed_records() -> dict[int, dict]:
    """base seed -> the signed arm's finished record."""
    out = {}
    for line in (HERE / "results_fss_plan.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["policy"] == "snip" and r["status"] == "ok":
            out[r["seed"]] = r
    return out


def main() -> None:
    ref, sig = records(), signed_records()
    bases = [b for b in BASES if b in sig]
    final = {"signed": {b: sig[b]["final"] for b in bases}}
    bf16 = {"signed": {b: evaluated(sig[b]["name"], "bf16", SIGNED) for b in bases}}
    own = max(abs(evaluated(sig[b]["name"], "checkpoint", SIGNED)[d] - final["signed"][b][d]) for b in bases for d in DOMAINS)
    for arm in ("bf16", "snip", "tail+switch"):
        final[arm] = {b: ref[arm][b]["final"] for b in bases}
        bf16[arm] = {b: final[arm][b] if arm == "bf16" else evaluated(ref[arm][b]["name"], "bf16") for b in bases}
    print(f"Bases: {', '.join(map(str, bases))}. Check: own-plan re-evaluation against the recorded final loss, "
          f"largest |difference| {own:.2e}. FP4 fprop GEMMs in the signed arm's last plan: "
          + ", ".join(str(fprop_in_fp4(sig[b]["name"], SIGNED)[0]) for b in bases) + " of 32.\n")

    def parts(arm: str, b: int, d: str) -> dict[str, float]:
        return {"gap": final[arm][b][d] - final["bf16"][b][d], "forward": final[arm][b][d] - bf16[arm][b][d],
                "weights": bf16[arm][b][d] - bf16["bf16"][b][d]}

    print("| A − B | domain | gap | forward part | weights part | per base gap |")
    print("|---|---|---|---|---|---|")
    for other in ("bf16", "snip", "tail+switch"):
        for d in DOMAINS:
            diff = {b: {p: parts("signed", b, d)[p] - (parts(other, b, d)[p] if other != "bf16" else 0.0) for p in PARTS}
                    for b in bases}
            print(f"| signed − `{other}` | `{d}` | " + " | ".join(mean_se([diff[b][p] for b in bases]) for p in PARTS)
                  + " | " + ", ".join(f"{diff[b]['gap']:+.4f}" for b in bases) + " |")


if __name__ == "__main__":
    main()
