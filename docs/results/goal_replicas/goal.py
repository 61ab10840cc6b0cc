"""The goal test's claims (protocol.md): shipped ``snip``, NVIDIA's ``tail+switch`` and ``snip+switch`` at
6.46M, ρ = 0.9, on the reported seeds' bases 1-4 × continuation data orders 0-5.

    python docs/results/goal_replicas/goal.py > docs/results/goal_replicas/table.md

Reads the committed records: ``results_gr4_o<k>_plan.jsonl`` (``snip``) and ``results_gr4_o<k>_run.jsonl``
(``tail+switch``, ``snip+switch``) for orders 1-5 and ``snip+switch`` at order 0; order 0's ``snip``, BF16
and ``tail+switch`` are ``../bf16_time/``'s ``results_bt4_plan.jsonl`` and ``results_bt4_run.jsonl``. Each
contrast A − B is decomposed per domain as ``../replicas/replicas.py`` does (its ``decompose``: the mean
over the 4 bases of each base's mean over its orders, SE over the bases with 3 df; the pooled
within-base SD over orders s_w and the base's own part τ), and read by the protocol's rules.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "replicas"))
from replicas import DOMAINS, decompose, finals  # one decomposition for both studies

ORDERS = range(6)
BF16_TIME = HERE.parent / "bf16_time"
ARMS = {"snip": ("snip", "plan"), "tail+switch": ("tail+switch", "run"),
        "snip+switch": ("snip+switch", "run")}  # arm -> (policy, out-dir kind)
# (A, B, what the protocol decides from A − B): claims 1-3.
CONTRASTS = (("snip", "tail+switch", "the goal's first part"),
             ("snip+switch", "tail+switch", "snip+switch against NVIDIA's recipe"),
             ("snip+switch", "snip", "the run budget as SNIP's default (item 6)"))


def records_path(arm: str, order: int) -> Path:
    """Where ``arm``'s records of one order are: order 0's ``snip`` and ``tail+switch`` are bf16_time's."""
    kind = ARMS[arm][1]
    if order == 0 and arm != "snip+switch":
        return BF16_TIME / f"results_bt4_{kind}.jsonl"
    return HERE / f"results_gr4_o{order}_{kind}.jsonl"


def load() -> dict[str, dict[tuple[int, int], dict[str, float]]]:
    """arm -> {(base seed, order): final losses}."""
    return {arm: {(seed, k): final for k in ORDERS for seed, final in finals(records_path(arm, k), policy).items()}
            for arm, (policy, _) in ARMS.items()}


def contrast(runs, a: str, b: str) -> dict[tuple[int, int], dict[str, float]]:
    """(base seed, order) -> {domain: A − B}, where both arms finished."""
    both = sorted(set(runs[a]) & set(runs[b]))
    return {key: {d: runs[a][key][d] - runs[b][key][d] for d in DOMAINS} for key in both}


def base_means(d: dict[tuple[int, int], float]) -> list[float]:
    """Each base's mean of ``d`` over its orders, in base order (what ``decompose`` averages)."""
    bases = sorted({b for b, _ in d})
    return [statistics.fmean(v for (b, _), v in d.items() if b == base) for base in bases]


def verdict(summary: dict[str, dict[str, float]], a: str, b: str) -> str:
    """The protocol's reading of A − B: A beats B if the training domain's d < −2 SE and no domain is
    worse by > 2 SE; B is ahead if the training domain's d > +2 SE; a tie otherwise."""
    train = summary["val_loss"]
    worse = [d for d in DOMAINS if summary[d]["mean"] > 2 * summary[d]["se"]]
    if train["mean"] < -2 * train["se"] and not worse:
        return f"`{a}` beats `{b}`"
    if train["mean"] > 2 * train["se"]:
        return f"`{b}` is ahead"
    note = f" (`{a}` worse by > 2 SE on " + ", ".join(f"`{d}`" for d in worse) + ")" if worse else ""
    return "a tie" + note


def against_bf16(runs) -> dict[str, dict[str, tuple[float, float, int]]]:
    """arm -> {domain: (mean, SE, seeds) of arm − the seed's BF16 run, both at order 0}."""
    bf16 = finals(BF16_TIME / "results_bt4_plan.jsonl", "bf16")
    out = {}
    for arm, per_key in runs.items():
        out[arm] = {}
        for dom in DOMAINS:
            d = [per_key[(s, 0)][dom] - bf16[s][dom] for s in sorted(bf16) if (s, 0) in per_key]
            out[arm][dom] = (statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5, len(d))
    return out


def report(runs) -> None:
    """Print each contrast's verdict, its per-domain decomposition and its pairs (markdown)."""
    print("Each arm's runs: " + ", ".join(f"`{arm}` {len(v)}" for arm, v in runs.items()) + ".\n")
    for a, b, what in CONTRASTS:
        data = contrast(runs, a, b)
        summary = {dom: decompose({key: v[dom] for key, v in data.items()}) for dom in DOMAINS}
        print(f"## `{a}` − `{b}`: {what}\n\nVerdict: **{verdict(summary, a, b)}**.\n")
        print("| domain | bases / pairs | d (± SE over bases) | d / SE | s_w: within base (df) | SD of base means | τ: base part "
              f"| pairs with `{a}` lower | median d | base means |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for dom, r in summary.items():
            d = {key: v[dom] for key, v in data.items()}
            print(f"| `{dom}` | {r['bases']} / {r['pairs']} | {r['mean']:+.4f} ± {r['se']:.4f} | {r['mean'] / r['se']:+.1f} "
                  f"| {r['s_w']:.4f} ({r['df_w']}) | {r['sd_means']:.4f} | {r['tau']:.4f} "
                  f"| {sum(x < 0 for x in d.values())} of {len(d)} | {statistics.median(d.values()):+.4f} "
                  f"| {', '.join(f'{m:+.4f}' for m in base_means(d))} |")
        print("\n| base | order | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |")
        print("|---|---|" + "---|" * len(DOMAINS))
        for (base, k), v in data.items():
            print(f"| {base} | {k} | " + " | ".join(f"{v[d]:+.4f}" for d in DOMAINS) + " |")
        print()


def main() -> None:
    runs = load()
    report(runs)
    print("## Each arm against the seed's BF16 run, both at order 0 (mean ± SE over seeds)\n")
    print("| arm | seeds | " + " | ".join(f"`{d}`" for d in DOMAINS) + " |")
    print("|---|---|" + "---|" * len(DOMAINS))
    for arm, per_dom in against_bf16(runs).items():
        n = next(iter(per_dom.values()))[2]
        print(f"| `{arm}` | {n} | " + " | ".join(f"{m:+.4f} ± {se:.4f}" for m, se, _ in per_dom.values()) + " |")


if __name__ == "__main__":
    main()
