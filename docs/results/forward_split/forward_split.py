"""Where each plan's gap to BF16 lies at 1.66M (protocol.md): the evaluated plan's own forward pass, or the
weights it trained. The development study's claims, and the split the other studies of this folder import.

    python docs/results/forward_split/forward_split.py > docs/results/forward_split/table.md

Reads the committed records beside it: ``results_fs_plan.jsonl`` (BF16, uniform ``fp4_block``, shipped
``snip``) and ``results_fs_run.jsonl`` (``tail+switch``, ``snip+switch``, run budget), and for each
continuation ``evals/o<order>_<run>_checkpoint.json`` and ``..._bf16.json`` (``megatron_snip.evaluate``
on its final checkpoint, in its own plan and with every GEMM in BF16) and ``..._plan.json`` (the plan
in force at the end). Per (base b, order k) and domain, with L the recorded final loss and E the same
weights evaluated in BF16:

    gap = L(arm) − L(BF16 run),  forward part = L(arm) − E(arm),  weights part = E(arm) − L(BF16 run)

(a BF16 run's own plan is BF16, so its E is its L; the check shows the re-evaluation reproduces every L).
Each part and each contrast A − B of parts is decomposed as ``../replicas/replicas.py`` does: the mean
over the bases of each base's mean over its orders, ± SE over the bases (3 df).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "replicas"))
sys.path.insert(0, str(HERE.parents[2]))  # the checkout: the package's own list of FP4 formats (no torch)
from replicas import DOMAINS, decompose  # one list of domains and one decomposition for every study

from megatron_snip.precision.formats import FP4_FORMATS

Key = tuple[int, int]  # (base seed, continuation order)
BASES = (11, 12, 13, 14)
ARMS = {p: p for p in ("bf16", "uniform:fp4_block", "snip", "tail+switch", "snip+switch")}  # policy -> arm
CONTRASTS = (("snip", "tail+switch"), ("snip+switch", "tail+switch"), ("snip+switch", "snip"))
EVAL_KEY = {"valid": "val_loss", "moby_dick": "val_loss_moby_dick", "python_docs": "val_loss_python_docs"}
PARTS = ("gap", "forward", "weights")


def records(sources: Iterable[tuple[Path, int]], arms: Mapping[str, str]) -> dict[str, dict[Key, dict]]:
    """arm -> {(base seed, order): its record}: the finished runs of each policy of ``arms`` (policy -> arm
    name) in each (results.jsonl, order) of ``sources``; a missing file holds none."""
    out: dict[str, dict[Key, dict]] = {arm: {} for arm in arms.values()}
    for path, order in sources:
        for line in path.read_text().splitlines() if path.is_file() else []:
            r = json.loads(line)
            if r["policy"] in arms and r["status"] == "ok":
                out[arms[r["policy"]]][(r["seed"], order)] = r
    return out


def eval_file(where: Path, key: Key, record: dict, what: str) -> Path:
    """``where/o<order>_<run>_<what>.json``: a re-evaluation (``checkpoint``, ``bf16``) or the last plan (``plan``)."""
    return where / f"o{key[1]}_{record['name']}_{what}.json"


def evaluated(path: Path) -> dict[str, float]:
    """{domain: loss} of one ``megatron_snip.evaluate`` JSON."""
    return {EVAL_KEY[k]: v["loss"] for k, v in json.loads(path.read_text())["domains"].items()}


def fprop_in_fp4(path: Path) -> tuple[int, int]:
    """(fprop GEMMs in FP4, fprop GEMMs) of a plan JSON."""
    fprops = [f for gemm, f in json.loads(path.read_text())["entries"].items() if gemm.endswith(".fprop")]
    return sum(f in FP4_FORMATS for f in fprops), len(fprops)


def own_plan_check(recs: Mapping[str, Mapping[Key, dict]], keys: Sequence[Key], where: Path) -> tuple[int, float]:
    """(losses compared, largest |re-evaluation in the run's own plan − recorded final loss|) over every
    own-plan re-evaluation on file."""
    diffs = [abs(evaluated(f)[d] - r["final"][d]) for per in recs.values() for key in keys
             if (f := eval_file(where, key, r := per[key], "checkpoint")).is_file() for d in DOMAINS]
    return len(diffs), max(diffs)


def split(recs: Mapping[str, Mapping[Key, dict]], keys: Sequence[Key],
          where: Callable[[str], Path]) -> dict[str, dict[Key, dict[str, dict[str, float]]]]:
    """arm -> key -> domain -> {gap, forward, weights} for every arm but ``bf16`` (the docstring's
    formulas); ``where(arm)`` is the folder of that arm's evaluations."""
    ref = {key: recs["bf16"][key]["final"] for key in keys}
    out = {}
    for arm, per in recs.items():
        if arm == "bf16":
            continue
        out[arm] = {}
        for key in keys:
            final, in_bf16 = per[key]["final"], evaluated(eval_file(where(arm), key, per[key], "bf16"))
            out[arm][key] = {d: {"gap": final[d] - ref[key][d], "forward": final[d] - in_bf16[d],
                                 "weights": in_bf16[d] - ref[key][d]} for d in DOMAINS}
    return out


def report(parts, keys: Sequence[Key], contrasts: Sequence[tuple[str, str]], fp4_counts: Mapping[str, str]) -> None:
    """Print each arm − BF16, each contrast A − B and the per-(base, order) training-domain contrasts, split."""
    print("## Each arm − BF16, split (mean over the bases of their means over orders ± SE over the bases)\n")
    print("| arm | fprop GEMMs in FP4 at the end (per run) | domain | gap | forward part | weights part |")
    print("|---|---|---|---|---|---|")
    for arm, per in parts.items():
        for d in DOMAINS:
            cells = [decompose({key: per[key][d][p] for key in keys}) for p in PARTS]
            print(f"| `{arm}` | {fp4_counts[arm]} | `{d}` | " + " | ".join(f"{c['mean']:+.4f} ± {c['se']:.4f}" for c in cells) + " |")
    print("\n## Contrasts A − B, split the same way\n")
    print("| A − B | domain | gap | forward part | weights part | pairs with A lower: gap; forward; weights |")
    print("|---|---|---|---|---|---|")
    for a, b in contrasts:
        for d in DOMAINS:
            diff = {key: {p: parts[a][key][d][p] - parts[b][key][d][p] for p in PARTS} for key in keys}
            cells = [decompose({key: diff[key][p] for key in keys}) for p in PARTS]
            lower = "; ".join(f"{sum(diff[key][p] < 0 for key in keys)} of {len(keys)}" for p in PARTS)
            print(f"| `{a}` − `{b}` | `{d}` | " + " | ".join(f"{c['mean']:+.4f} ± {c['se']:.4f} ({c['mean'] / c['se']:+.1f} SE)"
                                                        for c in cells) + f" | {lower} |")
    print("\nPer (base, order), training domain (`val_loss`): gap; forward; weights of each contrast\n")
    print("| base | order | " + " | ".join(f"`{a}` − `{b}`" for a, b in contrasts) + " |")
    print("|---|---|" + "---|" * len(contrasts))
    for key in keys:
        print(f"| {key[0]} | {key[1]} | " + " | ".join(", ".join(
            f"{parts[a][key]['val_loss'][p] - parts[b][key]['val_loss'][p]:+.4f}" for p in PARTS) for a, b in contrasts) + " |")


def counts(recs: Mapping[str, Mapping[Key, dict]], keys: Sequence[Key], where: Callable[[str], Path]) -> dict[str, str]:
    """arm -> "n, n, ... of N": FP4 fprop GEMMs in each run's last plan."""
    out = {}
    for arm, per in recs.items():
        found = [fprop_in_fp4(eval_file(where(arm), key, per[key], "plan")) for key in keys]
        out[arm] = ", ".join(str(n) for n, _ in found) + f" of {found[0][1]}"
    return out


def whole(recs: Mapping[str, Mapping[Key, dict]], candidates: Iterable[Key]) -> list[Key]:
    """The candidate keys every arm finished."""
    return sorted(key for key in candidates if all(key in per for per in recs.values()))


def main() -> None:
    recs = records([(HERE / "results_fs_plan.jsonl", 0), (HERE / "results_fs_run.jsonl", 0)], ARMS)
    keys = whole(recs, [(b, 0) for b in BASES])
    n, worst = own_plan_check(recs, keys, HERE / "evals")
    print(f"Bases with every arm finished: {', '.join(str(b) for b, _ in keys)} (order 0).\n")
    print(f"Check: the re-evaluation in each run's own plan against its recorded final loss, largest |difference| "
          f"over {n} losses: {worst:.2e}.\n")
    parts = split(recs, keys, lambda arm: HERE / "evals")
    report(parts, keys, CONTRASTS, counts({a: recs[a] for a in parts}, keys, lambda arm: HERE / "evals"))


if __name__ == "__main__":
    main()
