"""Each development run's last plan on the other arms' weights (protocol_cross.md): does shipped SNIP's
forward part come from its last plan, or from weights that adapted to another one?

    python docs/results/forward_split/cross.py > docs/results/forward_split/table_cross.md

Reads, for the arms ``snip``, ``tail+switch`` and ``snip+switch`` on development bases 11-14 (order 0):
``evals/o0_<run>_{checkpoint,bf16}.json`` (a run's final checkpoint in its own last plan and in BF16,
forward_split's) and ``evals_cross/o0_<run>_in_<arm>.json`` (the same checkpoint in ``arm``'s last plan of
that base). With E(W, P) the evaluated loss of arm W's weights in arm P's last plan, the forward cost is
F(W, P) = E(W, P) − E(W, BF16); every figure is the mean over the 4 bases ± SE over them (3 df).
"""

from __future__ import annotations

import statistics
import sys
from math import sqrt
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from forward_split import BASES, DOMAINS, evaluated

RUN = {"snip": "snip", "tail+switch": "tail-switch", "snip+switch": "snip-switch"}  # arm -> run-name prefix


def loss(w: str, p: str, base: int) -> dict[str, float]:
    """{domain: E(W, P)} of arm ``w``'s final weights on ``base`` in arm ``p``'s last plan (``bf16``: every GEMM)."""
    run = f"o0_{RUN[w]}_fp8_block-fp4_block_rho0.9_seed{base}"
    if p == w:
        return evaluated(HERE / "evals" / f"{run}_checkpoint.json")
    if p == "bf16":
        return evaluated(HERE / "evals" / f"{run}_bf16.json")
    return evaluated(HERE / "evals_cross" / f"{run}_in_{RUN[p]}.json")


def forward(w: str, p: str) -> dict[int, dict[str, float]]:
    """base -> domain -> F(W, P)."""
    out = {}
    for b in BASES:
        in_plan, in_bf16 = loss(w, p, b), loss(w, "bf16", b)
        out[b] = {d: in_plan[d] - in_bf16[d] for d in DOMAINS}
    return out


def cell(values: list[float]) -> str:
    m, se = statistics.fmean(values), statistics.stdev(values) / sqrt(len(values))
    return f"{m:+.4f} ± {se:.4f} ({m / se:+.1f} SE)"


def main() -> None:
    arms = list(RUN)
    f = {(w, p): forward(w, p) for w in arms for p in arms}
    print("## 1. Forward cost F(W, P) = E(W, P) − E(W, BF16): rows the weights, columns the last plan\n")
    for d in DOMAINS:
        print(f"`{d}`\n\n| weights \\ plan | " + " | ".join(f"`{p}`" for p in arms) + " |\n|---|" + "---|" * len(arms))
        for w in arms:
            print(f"| `{w}` | " + " | ".join(cell([f[w, p][b][d] for b in BASES]) for p in arms) + " |")
        print()
    print("## 2. Plan effect on fixed weights: F(W, P_snip) − F(W, P_tail+switch)\n")
    print("| weights | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |\n|---|" + "---|" * len(DOMAINS))
    for w in arms:
        print(f"| `{w}` | " + " | ".join(cell([f[w, "snip"][b][d] - f[w, "tail+switch"][b][d] for b in BASES])
                                         for d in DOMAINS) + " |")
    print("\n## 3. Adaptation: F(W_A, P_A) − F(W_B, P_A), a plan on its own weights against another arm's\n")
    print("| plan A | weights B | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |\n|---|---|" + "---|" * len(DOMAINS))
    for a in arms:
        for b_arm in arms:
            if a != b_arm:
                print(f"| `{a}` | `{b_arm}` | " + " | ".join(cell([f[a, a][b][d] - f[b_arm, a][b][d] for b in BASES])
                                                             for d in DOMAINS) + " |")


if __name__ == "__main__":
    main()
