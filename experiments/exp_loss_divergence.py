"""Why SNIP's loss divergence ranks linears poorly, and which estimator ranks them well (#25 item 2).

    python -m experiments.exp_loss_divergence --seed 21 --out docs/results/validation/loss_divergence/seed21.json

On the comparison's model (``experiments.comparison.protocol.DEFAULT_SETS``: 8 blocks, d=128, 32
linears) trained in BF16 for --steps at constant LR (the continued protocol's base checkpoint; a
run directory per seed under --run-root, resumed when present), with candidates --formats:

1. The truth (``snip.truth.loss_changes``): per linear ℓ and format f, the loss with only ℓ's
   fprop in f minus the reference loss, averaged over --truth-batches held-out micro-batches; its
   split-half reliability says how well any estimate can be expected to rank against it.
2. The probe truth: the same measured on the probe micro-batches of window 0 (training data): the
   best any estimate from those batches could do, short of seeing the held-out data; with
   --probe-truth-batches, on the first N of them for each N (how many probe batches it would take).
3. For every probe setting (P micro-batches, D noise draws, the curvature noise's direction) on
   --windows disjoint windows of training data after the checkpoint, a statistics snapshot
   (``StatsCollector.collect``, as a re-plan runs it) and from it several loss-divergence formulas
   (``FORMULAS``: which first-order term, with or without the curvature term), each scored by its
   Spearman correlation with the truth per format and pooled.

Seeds used here are development seeds: nothing reported under docs/results/ (seeds 1-4) is used.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from experiments import validate_metrics as vm
from experiments.comparison.protocol import DEFAULT_SETS
from megatron_snip.snip.controller import draw_micro_batches
from megatron_snip.snip.metrics import curvature
from megatron_snip.snip.stats import ProbeConfig, StatsCollector
from megatron_snip.snip.truth import loss_changes

# Loss-divergence formulas from one linear's sums in one format (n probe micro-batches). "abs": the
# mean per-batch |<G_b, e_b>| (today's first-order term); "mean": |mean_b <G_b, e_b>| (the systematic
# part, what a mean over many batches keeps); "signed": mean_b <G_b, e_b> with its sign (a systematic
# first-order gain, which the truth of a checkpoint off a stationary point contains, ranks low);
# "k": ½·max(κ, 0)·mean_b ‖e_b‖².
FORMULAS = {
    "signed+k": lambda pf, k, n: pf["grad_dot_ey"] / n + 0.5 * k * pf["sq_ey"] / n,
    # the weight error's share of the signed first-order term from AdamW's momentum, not the probe batches
    "msigned+k": lambda pf, k, n: (pf["m_dot_ew"] + (pf["grad_dot_ey"] - pf["grad_dot_ew"]) / n
                                   + 0.5 * k * pf["sq_ey"] / n),
    "msigned": lambda pf, k, n: pf["m_dot_ew"] + (pf["grad_dot_ey"] - pf["grad_dot_ew"]) / n,
    "signed": lambda pf, k, n: pf["grad_dot_ey"] / n,
    "abs+k": lambda pf, k, n: pf["abs_grad_dot_ey"] / n + 0.5 * k * pf["sq_ey"] / n,
    "abs": lambda pf, k, n: pf["abs_grad_dot_ey"] / n,
    "mean+k": lambda pf, k, n: abs(pf["grad_dot_ey"]) / n + 0.5 * k * pf["sq_ey"] / n,
    "mean": lambda pf, k, n: abs(pf["grad_dot_ey"]) / n,
    "k": lambda pf, k, n: 0.5 * k * pf["sq_ey"] / n,
    "sq_ey": lambda pf, k, n: pf["sq_ey"] / n,
}
# (probe micro-batches, noise draws, curvature noise): today's default first.
SETTINGS = ((2, 2, "gaussian"), (2, 2, "error"), (2, 1, "error"))


def predictions(snap: dict, formats: tuple[str, ...]) -> dict[str, dict[tuple[str, str], float]]:
    n = snap["num_probe_batches"]
    out: dict[str, dict[tuple[str, str], float]] = {name: {} for name in FORMULAS}
    for key, s in snap["linears"].items():
        k = max(curvature(s), 0.0)
        for f in formats:
            for name, formula in FORMULAS.items():
                out[name][key, f] = formula(s["per_format"][f], k, n)
    return out


def scores(pred: dict[tuple[str, str], float], truth: dict[tuple[str, str], float],
           formats: tuple[str, ...]) -> dict[str, float]:
    """Spearman of ``pred`` against ``truth`` per format and pooled ("all")."""
    out = {f: vm.spearman([pred[k] for k in truth if k[1] == f], [truth[k] for k in truth if k[1] == f])
           for f in formats}
    out["all"] = vm.spearman([pred[k] for k in truth], [truth[k] for k in truth])
    return out


SUMMARY_FORMULAS = ("abs+k", "k", "signed+k", "signed", "msigned+k")


def summarize(paths: list[str]) -> str:
    """A markdown table of Spearman ρ per seed, setting and formula against the truth, its even part
    and its odd part (``--summarize`` prints it)."""
    lines = ["| seed | setting (P×D×noise) | stats s | " + " | ".join(SUMMARY_FORMULAS) + " |",
             "|---|---|---|" + "---|" * len(SUMMARY_FORMULAS)]
    notes = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        rel = d["truth_reliability_split_half"]["all"]
        notes.append(f"seed {d['seed']}: truth split-half ρ {rel:.2f} (Spearman-Brown {2 * rel / (1 + rel):.2f} for all "
                     f"{d['truth_batches']} batches); the probe truth (ΔL measured on the first 2 probe batches) "
                     f"against it: {d['results'][0]['spearman']['all']:.2f}"
                     + ("; measured on N probe batches: " + ", ".join(f"{n}: {c['all']:.2f}" for n, c in
                                                                      d["probe_truth_curve"].items())
                        if "probe_truth_curve" in d else ""))
        for r in d["results"][1:]:
            cells = [f"{r['spearman'][n]['all']:.2f} / {r['spearman_vs_even'][n]:.2f} / {r['spearman_vs_odd'][n]:.2f}"
                     for n in SUMMARY_FORMULAS]
            lines.append(f"| {d['seed']} | {r['setting']} | {r['stats_s']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print the summary table of these outputs; run nothing")
    ap.add_argument("--config", default="launch/configs/tiny.toml")
    ap.add_argument("--seed", type=int, help="a development seed (not 1-4, the reported ones)")
    ap.add_argument("--steps", type=int, default=1000, help="BF16 steps of the checkpoint (the comparison's base)")
    ap.add_argument("--run-root", default="runs/loss_divergence")
    ap.add_argument("--formats", default="fp8_block,fp4_block", help="the candidates (statistics)")
    ap.add_argument("--truth-formats", default="fp4_block",
                    help="formats the estimates are scored in (the FP4 one decides the plan; fp8_block's ΔL is ~0)")
    ap.add_argument("--truth-batches", type=int, default=16)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--probe-truth-batches", default="2",
                    help="comma-separated counts N: the loss change measured exactly on window 0's first N probe "
                         "batches, scored against the truth, per N (the ranking any estimate from N probe batches "
                         "is held to: what more probe data could buy)")
    ap.add_argument("--settings", default=",".join(f"{p}x{d}x{kind}" for p, d, kind in SETTINGS),
                    help="probe settings PxDxNOISE (micro-batches, draws, gaussian|error), comma-separated")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize), end="")
        return 0
    if args.seed is None or args.out is None:
        ap.error("--seed and --out are required (or --summarize)")
    if args.seed in (1, 2, 3, 4):
        raise SystemExit("error: --seed 1-4 are the comparison's reported seeds; use a development seed")
    formats = tuple(args.formats.split(","))
    scored = tuple(args.truth_formats.split(","))
    settings = [(int(p), int(d), kind) for p, d, kind in (s.split("x") for s in args.settings.split(","))]
    counts = sorted({int(n) for n in args.probe_truth_batches.split(",")})

    overrides = [*DEFAULT_SETS, f"training.seed={args.seed}", f"snip.seed={args.seed}",
                 'training.lr_schedule="constant"', *args.overrides]
    t0 = time.perf_counter()
    trainer = vm.trained_trainer(args.config, overrides, args.steps, f"{args.run_root}/seed{args.seed}")
    train_s = time.perf_counter() - t0
    t = trainer.cfg.training

    t0 = time.perf_counter()
    out = Path(args.out)
    cached = json.loads(out.read_text()) if out.exists() else {}
    same = {k: cached.get(k) for k in ("seed", "steps", "truth_batches", "truth_formats")} == {
        "seed": args.seed, "steps": args.steps, "truth_batches": args.truth_batches, "truth_formats": list(scored)}
    if same and "truth_per_batch" in cached:  # the truth of this checkpoint was measured already: reuse it
        per_batch = {tuple(k.split(":")): v for k, v in cached["truth_per_batch"].items()}
    else:
        per_batch = loss_changes(trainer, scored, vm.held_out_batches(trainer, args.truth_batches))
    if same and "truth_mirrored_per_batch" in cached:
        mirrored = {tuple(k.split(":")): v for k, v in cached["truth_mirrored_per_batch"].items()}
    else:
        mirrored = loss_changes(trainer, scored, vm.held_out_batches(trainer, args.truth_batches), mirrored=True)
    truth = {k: float(np.mean(v)) for k, v in per_batch.items()}
    # The truth's even (second-order) and odd (first-order) parts, from the loss changes at +e and -e.
    truth_even = {k: 0.5 * (truth[k] + float(np.mean(mirrored[k]))) for k in truth}
    truth_odd = {k: 0.5 * (truth[k] - float(np.mean(mirrored[k]))) for k in truth}
    halves = [{k: float(np.mean(v[h::2])) for k, v in per_batch.items()} for h in (0, 1)]
    reliability = {f: vm.spearman([halves[0][k] for k in truth if f in ("all", k[1])],
                                  [halves[1][k] for k in truth if f in ("all", k[1])]) for f in (*scored, "all")}
    truth_s = time.perf_counter() - t0
    print(f"truth in {truth_s:.0f}s; split-half reliability {reliability}", flush=True)

    first = args.steps * t.global_batch_size
    stride = max(p for p, _, _ in settings) * t.micro_batch_size

    def probe(window: int, count: int) -> list:
        return draw_micro_batches(trainer.data.train, first + window * stride, count, t.micro_batch_size,
                                  trainer.device)

    # The probe truth: measured on window 0's first probe batches (2, today's default probe, in the
    # results; each of --probe-truth-batches in the curve). A measurement of more batches extends a cached one.
    need = max(counts + [2])
    probe_per_batch = ({tuple(k.split(":")): v for k, v in cached["probe_truth_per_batch"].items()}
                       if same and "probe_truth_per_batch" in cached else {})
    have = min((len(v) for v in probe_per_batch.values()), default=0)
    if have < need:
        more = loss_changes(trainer, scored, probe(0, need)[have:])
        probe_per_batch = {k: probe_per_batch.get(k, [])[:have] + v for k, v in more.items()}

    def probe_truth_of(n: int) -> dict:
        return {k: float(np.mean(v[:n])) for k, v in probe_per_batch.items()}

    probe_truth = probe_truth_of(2)
    probe_truth_curve = {n: scores(probe_truth_of(n), truth, scored) for n in counts}
    results = [{"setting": "probe truth (measured on the probe batches)",
                "spearman": scores(probe_truth, truth, scored)}]
    print(f"probe truth: {results[0]['spearman']}; on N probe batches: "
          f"{ {n: round(c['all'], 2) for n, c in probe_truth_curve.items()} }", flush=True)
    for p, d, kind in settings:
        collector = StatsCollector(ProbeConfig(formats=formats, noise_draws=d, seed=args.seed, curvature_noise=kind,
                                               compiled_quantizers=trainer.cfg.precision.compile_quantizers))
        per_window = []
        for w in range(args.windows):
            tw = time.perf_counter()
            snap = collector.collect(trainer, probe(w, p), trainer.step)
            preds = predictions(snap, scored)
            per_window.append({"stats_s": time.perf_counter() - tw,
                               "spearman": {name: scores(pred, truth, scored) for name, pred in preds.items()},
                               "spearman_vs_even": {name: scores(pred, truth_even, scored)["all"]
                                                    for name, pred in preds.items()},
                               "spearman_vs_odd": {name: scores(pred, truth_odd, scored)["all"]
                                                   for name, pred in preds.items()},
                               "curvature": {key: curvature(s) for key, s in snap["linears"].items()}})
        row = {"setting": f"{p}x{d}x{kind}", "probe_batches": p, "noise_draws": d, "curvature_noise": kind,
               "stats_s": statistics.median(r["stats_s"] for r in per_window),
               "spearman": {name: {f: statistics.fmean(r["spearman"][name][f] for r in per_window)
                                   for f in (*scored, "all")} for name in FORMULAS},
               "spearman_vs_even": {name: statistics.fmean(r["spearman_vs_even"][name] for r in per_window)
                                    for name in FORMULAS},
               "spearman_vs_odd": {name: statistics.fmean(r["spearman_vs_odd"][name] for r in per_window)
                                   for name in FORMULAS},
               "windows": per_window}
        results.append(row)
        print(f"{row['setting']:>14} ({row['stats_s']:.1f}s): " + "  ".join(
            f"{name} {row['spearman'][name]['all']:.2f} (even {row['spearman_vs_even'][name]:.2f}, "
            f"odd {row['spearman_vs_odd'][name]:.2f})" for name in FORMULAS), flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": shlex.join(["python", "-m", "experiments.exp_loss_divergence", *(sys.argv[1:] if argv is None else argv)]),
        "seed": args.seed, "steps": args.steps, "formats": list(formats), "truth_formats": list(scored),
        "truth_batches": args.truth_batches,
        "windows": args.windows, "train_s": train_s, "truth_s": truth_s, "truth_reliability_split_half": reliability,
        "truth": {f"{k[0]}:{k[1]}": v for k, v in truth.items()},
        "truth_per_batch": {f"{k[0]}:{k[1]}": v for k, v in per_batch.items()},
        "truth_mirrored_per_batch": {f"{k[0]}:{k[1]}": v for k, v in mirrored.items()},
        "truth_even": {f"{k[0]}:{k[1]}": v for k, v in truth_even.items()},
        "truth_odd": {f"{k[0]}:{k[1]}": v for k, v in truth_odd.items()},
        "probe_truth_per_batch": {f"{k[0]}:{k[1]}": v for k, v in probe_per_batch.items()},
        "probe_truth": {f"{k[0]}:{k[1]}": v for k, v in probe_truth.items()},
        "probe_truth_curve": {str(n): c for n, c in probe_truth_curve.items()}, "results": results}, indent=1))
    print(f"wrote {out}")
    trainer.logger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
