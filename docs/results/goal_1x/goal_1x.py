"""The goal test at 1.66M (protocol.md): BF16, uniform ``fp4_block``, shipped ``snip``, NVIDIA's
``tail+switch`` and ``snip+switch`` at ρ = 0.9 on the reported seeds' 1.66M bases 1-4 × continuation
data orders 0-3.

    python docs/results/goal_1x/goal_1x.py > docs/results/goal_1x/table.md

Reads the committed records ``results_g1_o<k>_plan.jsonl`` (BF16, uniform, ``snip``) and
``results_g1_o<k>_run.jsonl`` (``tail+switch``, ``snip+switch``); an order is used only where all five
arms finished on all four bases (the protocol's whole orders). The contrasts and their reading are
``../goal_replicas/goal.py``'s (imported: one place), and so is the decomposition of ``../replicas/``
(mean over the 4 bases of each base's mean over its orders, SE over the bases with 3 df). Recovered
share per base: 1 − mean over orders of (arm − BF16) / mean over orders of (uniform − BF16), per domain;
mean ± SE over the bases.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "replicas"))
sys.path.insert(0, str(HERE.parent / "goal_replicas"))
from goal import base_means, contrast, report, verdict  # the goal test's contrasts, rules and tables
from replicas import DOMAINS, decompose, finals

ORDERS = range(4)
BASES = (1, 2, 3, 4)
ARMS = {"bf16": "plan", "uniform:fp4_block": "plan", "snip": "plan", "tail+switch": "run", "snip+switch": "run"}
GOAL_SHARE = 0.8  # issue #33: recover ≥ 80% of uniform FP4's gap to BF16


Runs = dict[str, dict[tuple[int, int], dict[str, float]]]  # arm -> {(base seed, order): final losses}


def records_path(arm: str, order: int) -> Path:
    """This study's records of ``arm`` (one of ``ARMS``) at data order ``order``."""
    return HERE / f"results_g1_o{order}_{ARMS[arm]}.jsonl"


def arm_runs(policy: str, path: Callable[[int], Path]) -> dict[tuple[int, int], dict[str, float]]:
    """{(base seed, order): final losses} of ``policy``'s finished runs in ``path(order)`` for every order."""
    return {(seed, k): final for k in ORDERS for seed, final in finals(path(k), policy).items()}


def whole_orders(runs: Runs) -> Runs:
    """``runs`` on the orders every arm finished on every base (the protocols' whole orders)."""
    whole = [k for k in ORDERS if all((b, k) in per for per in runs.values() for b in BASES)]
    return {arm: {key: v for key, v in per.items() if key[1] in whole} for arm, per in runs.items()}


def load() -> Runs:
    """This study's arms, whole orders only."""
    return whole_orders({arm: arm_runs(arm, lambda k, arm=arm: records_path(arm, k)) for arm in ARMS})


def check_against_records(what: str, path: Path, policy: str, order: int = 0, reference: Path | None = None) -> None:
    """Print whether the final losses of ``policy`` in ``path`` (a check rerun at data order ``order``) equal
    the records of the same runs in ``reference`` (default: this study's) bit for bit."""
    now = finals(path, policy)
    ref = finals(reference or records_path(policy, order), policy)
    same = bool(now) and all(s in ref and now[s] == ref[s] for s in now)
    source = "goal_1x's records" if reference is None else f"`{reference.parent.name}/{reference.name}`"
    print(f"Check: {what} on bases {', '.join(map(str, sorted(now)))}, order {order}, against {source} "
          f"({sum(len(v) for v in now.values())} final losses): {'identical' if same else 'DIFFERENT'}.\n")


def enough_orders(runs: Runs, arm: str) -> bool:
    """Print the whole orders (``arm``'s, on ``runs`` after ``whole_orders``) and every arm's number of runs;
    False, with the protocols' no-claim line, when fewer than two orders are whole."""
    orders = sorted({k for _, k in runs[arm]})
    print(f"Whole orders: {orders} (of {list(ORDERS)}); every arm's runs: "
          + ", ".join(f"`{a}` {len(v)}" for a, v in runs.items()) + ".\n")
    if len(orders) < 2:
        print("Fewer than two whole orders: no claim (protocol.md).")
    return len(orders) >= 2


def recovered(runs, arm: str, dom: str) -> list[float]:
    """Each base's share of uniform's gap to BF16 that ``arm`` recovers on ``dom`` (means over its orders)."""
    gap = {name: {key: v[dom] for key, v in contrast(runs, name, "bf16").items()} for name in (arm, "uniform:fp4_block")}
    return [1 - a / u for a, u in zip(base_means(gap[arm]), base_means(gap["uniform:fp4_block"]))]


def mean_se(xs: list[float]) -> str:
    """Mean ± SE over bases, as the results pages print recovered shares."""
    return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.2f}"


def contrast_table(runs: Runs, pairs: Iterable[tuple[str, str]], title: str, median: bool = False) -> None:
    """Print one row per (A, B) of ``pairs``: goal.py's verdict, each domain's A − B (mean over the bases of
    their means over orders ± SE over the bases), the pairs with A lower on the training domain and, with
    ``median``, their median d."""
    bases = len({b for per in runs.values() for b, _ in per})
    print(f"## {title} (mean over the {bases} bases of their means over orders ± SE over the bases)\n")
    print("| A − B | verdict | " + " | ".join(f"`{d}`" for d in DOMAINS) + " | pairs with A lower (training) |")
    print("|---|---|" + "---|" * len(DOMAINS) + "---|")
    for a, b in pairs:
        data = contrast(runs, a, b)
        summary = {d: decompose({key: v[d] for key, v in data.items()}) for d in DOMAINS}
        lower = sum(v["val_loss"] < 0 for v in data.values())
        tail = f"; median {statistics.median(v['val_loss'] for v in data.values()):+.4f}" if median else ""
        print(f"| `{a}` − `{b}` | {verdict(summary, a, b)} | "
              + " | ".join(f"{r['mean']:+.4f} ± {r['se']:.4f} ({r['mean'] / r['se']:+.1f} SE)" for r in summary.values())
              + f" | {lower} of {len(data)}{tail} |")


def recovered_table(runs: Runs, arms: Iterable[str]) -> None:
    """Print each of ``arms``' share of uniform's gap to BF16 recovered, per domain (mean ± SE over the bases)."""
    print(f"\n## Share of uniform `fp4_block`'s gap to BF16 recovered (goal: ≥ {GOAL_SHARE})\n")
    print("| arm | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |\n|---|" + "---|" * len(DOMAINS))
    for arm in arms:
        print(f"| `{arm}` | " + " | ".join(mean_se(recovered(runs, arm, d)) for d in DOMAINS) + " |")


def tables(runs: Runs) -> None:
    """Print the claims' tables (markdown) for ``runs`` (arm -> {(base, order): final losses}, the arms of
    ``ARMS``): the contrasts, each arm against BF16 and the recovered shares."""
    orders = sorted({k for _, k in runs["bf16"]})
    print(f"Whole orders: {orders if orders else 'none'} (of {list(ORDERS)}).\n")
    if len(orders) < 2:
        print("Fewer than two whole orders: no claim (protocol.md).")
        return
    report(runs)
    print("## Each arm against BF16 of the same base and order (mean ± SE over the 4 bases' means)\n")
    print("| arm | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |")
    print("|---|" + "---|" * len(DOMAINS))
    for arm in ARMS:
        if arm == "bf16":
            continue
        vs_bf16 = contrast(runs, arm, "bf16")
        summaries = (decompose({key: v[dom] for key, v in vs_bf16.items()}) for dom in DOMAINS)
        cells = [f"{r['mean']:+.4f} ± {r['se']:.4f}" for r in summaries]
        print(f"| `{arm}` | " + " | ".join(cells) + " |")
    print(f"\n## Share of uniform `fp4_block`'s gap to BF16 recovered (goal: ≥ {GOAL_SHARE})\n")
    print("| arm | " + " | ".join(f"`{d}`" for d in DOMAINS) + " | training domain's distance to the goal |")
    print("|---|" + "---|" * len(DOMAINS) + "---|")
    for arm in ("snip", "tail+switch", "snip+switch"):
        shares = {dom: recovered(runs, arm, dom) for dom in DOMAINS}
        short = GOAL_SHARE - statistics.fmean(shares["val_loss"])
        print(f"| `{arm}` | " + " | ".join(mean_se(s) for s in shares.values())
              + f" | {'met' if short <= 0 else f'{short:.2f} short'} |")


def main() -> None:
    tables(load())


if __name__ == "__main__":
    main()
