"""Split the paired difference snip − tail+switch at 6.46M into what varies with the continuation's
data order and what belongs to the base (protocol.md).

    python docs/results/replicas/replicas.py > docs/results/replicas/table.md

Reads the committed records beside it: ``results_rp4_o<k>_plan.jsonl`` (``snip``, plan budget) and
``results_rp4_o<k>_run.jsonl`` (``tail+switch``, run budget) for orders k = 0, 1, 2; order 0's ``snip``
is ``../preconditioner/results_pc4_plan.jsonl``. A (base, order) pair counts when both arms finished.
Per domain: d(b, k) per pair; each base's mean over its orders; the pooled within-base SD s_w (df: pairs
minus bases); the SD of the base means; τ² = var(base means) − s_w² / (orders per base), floored at 0;
the mean over bases ± SE; and SE = sqrt((τ² + s_w²/R) / B) for B bases × R orders.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDERS = (0, 1, 2)
DOMAINS = ("val_loss", "val_loss_moby_dick", "val_loss_python_docs")
DESIGNS = ((4, 1), (4, 3), (4, 6), (8, 1), (8, 3))


def finals(path: Path, policy: str) -> dict[int, dict[str, float]]:
    """seed -> final losses of ``policy``'s finished runs in a results.jsonl (empty if absent)."""
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["policy"] == policy and r["status"] == "ok":
            out[r["seed"]] = r["final"]
    return out


ARMS = {"snip": ("snip", "plan"), "tail+switch": ("tail+switch", "run")}  # arm -> (policy, out-dir kind)


def records_path(order: int, kind: str) -> Path:
    """Where an order's records of one out-dir kind are: order 0's ``snip`` is the preconditioner study's."""
    if (order, kind) == (0, "plan"):
        return HERE / "../preconditioner/results_pc4_plan.jsonl"
    return HERE / f"results_rp4_o{order}_{kind}.jsonl"


def load() -> dict[str, dict[tuple[int, int], dict[str, float]]]:
    """arm -> {(base seed, order): final losses}, every record read once."""
    return {arm: {(seed, k): final for k in ORDERS for seed, final in finals(records_path(k, kind), policy).items()}
            for arm, (policy, kind) in ARMS.items()}


def pairs(runs: dict[str, dict[tuple[int, int], dict[str, float]]]) -> dict[tuple[int, int], dict[str, float]]:
    """(base seed, order) -> {domain: snip − tail+switch}, where both arms finished."""
    snip, rule = runs["snip"], runs["tail+switch"]
    return {key: {d: snip[key][d] - rule[key][d] for d in DOMAINS} for key in sorted(set(snip) & set(rule))}


def decompose(d: dict[tuple[int, int], float]) -> dict[str, float]:
    by_base: dict[int, list[float]] = {}
    for (b, _), v in sorted(d.items()):
        by_base.setdefault(b, []).append(v)
    means = [statistics.fmean(v) for v in by_base.values()]
    df_w = sum(len(v) - 1 for v in by_base.values())
    ss_w = sum((x - statistics.fmean(v)) ** 2 for v in by_base.values() for x in v)
    s_w = math.sqrt(ss_w / df_w) if df_w else float("nan")
    per_base = statistics.fmean(len(v) for v in by_base.values())
    sd_means = statistics.stdev(means) if len(means) > 1 else float("nan")
    tau2 = max(0.0, sd_means**2 - s_w**2 / per_base) if df_w and len(means) > 1 else float("nan")
    return {"bases": len(means), "pairs": len(d), "mean": statistics.fmean(means),
            "se": sd_means / math.sqrt(len(means)), "s_w": s_w, "df_w": df_w, "sd_means": sd_means, "tau": math.sqrt(tau2)}


def _within_base(values: dict[tuple[int, int], float]) -> dict[int, list[float]]:
    """base -> its values' deviations from the base's mean over orders (bases with one order left out)."""
    by_base: dict[int, list[float]] = {}
    for (b, _), v in sorted(values.items()):
        by_base.setdefault(b, []).append(v)
    return {b: [x - statistics.fmean(v) for x in v] for b, v in by_base.items() if len(v) > 1}


def arm_spread(runs: dict[str, dict[tuple[int, int], dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per domain: each arm's own final loss, SD over orders within a base (pooled over bases; the order
    moves every policy's loss level, so this is not the noise floor of a paired difference), and the
    within-base correlation of the two arms over orders (how much a shared order pairs them)."""
    both = sorted(set(runs["snip"]) & set(runs["tail+switch"]))
    out: dict[str, dict[str, float]] = {name: {} for name in (*ARMS, "correlation")}
    for dom in DOMAINS:
        dev = {arm: _within_base({key: runs[arm][key][dom] for key in both}) for arm in ARMS}
        df = sum(len(v) - 1 for v in dev["snip"].values())
        ss = {arm: sum(x * x for v in dev[arm].values() for x in v) for arm in ARMS}
        for arm in ARMS:
            out[arm][dom] = math.sqrt(ss[arm] / df) if df else float("nan")
        cross = sum(a * b for base in dev["snip"] for a, b in zip(dev["snip"][base], dev["tail+switch"][base]))
        out["correlation"][dom] = cross / math.sqrt(ss["snip"] * ss["tail+switch"]) if df else float("nan")
    return out


def main() -> None:
    runs = load()
    data = pairs(runs)
    print("| base | order | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |")
    print("|---|---|" + "---|" * len(DOMAINS))
    for (b, k), v in sorted(data.items()):
        print(f"| {b} | {k} | " + " | ".join(f"{v[d]:+.4f}" for d in DOMAINS) + " |")
    print("\n| domain | bases / pairs | snip − tail+switch (± SE over bases) | s_w: within base (df) | SD of base means | τ: base part | "
          + " | ".join(f"SE, {b} bases × {r}" for b, r in DESIGNS) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(DESIGNS))
    for dom in DOMAINS:
        r = decompose({key: v[dom] for key, v in data.items()})
        ses = [math.sqrt((r["tau"] ** 2 + r["s_w"] ** 2 / rr) / b) for b, rr in DESIGNS]
        print(f"| `{dom}` | {r['bases']} / {r['pairs']} | {r['mean']:+.4f} ± {r['se']:.4f} | {r['s_w']:.4f} ({r['df_w']}) "
              f"| {r['sd_means']:.4f} | {r['tau']:.4f} | " + " | ".join(f"{s:.4f}" for s in ses) + " |")

    print("\nEach arm's final loss over orders (SD within a base, pooled; the order moves every policy's loss too), "
          "and the two arms' correlation over orders within a base:\n")
    print("| | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |")
    print("|---|" + "---|" * len(DOMAINS))
    for name, per_domain in arm_spread(runs).items():
        print(f"| {name} | " + " | ".join(f"{per_domain[d]:.4f}" if name in ARMS else f"{per_domain[d]:+.2f}"
                                          for d in DOMAINS) + " |")

if __name__ == "__main__":
    main()
