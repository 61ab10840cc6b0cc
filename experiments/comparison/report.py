"""The comparison's markdown report (``docs/results/comparison/results.md``): protocol, tables per validation domain,
loss curves, the rho sweep, SNIP's precision maps, costs, the metric validation's summary and
the hand-written discussion. Everything comes from the records and the protocol, nothing from
the runs' logs."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from experiments.comparison.aggregate import Row, aggregate, by_seed, group_order, paired, sample_std
from experiments.comparison.figures import plot_curves
from experiments.comparison.protocol import (
    BASE_POLICY,
    CONTINUATION_ORDER_STRIDE,
    FORMAT_POLICIES,
    STATIC_BASELINES,
    TRAIN_DOMAIN,
    Protocol,
    config_path,
    fmt_key,
    is_format_free,
)
from experiments.comparison.store import best_static_baseline, latest_records
from megatron_snip.config import Config, load_config
from megatron_snip.data.pipeline import load_tokenizer_for
from megatron_snip.model.llama import LlamaModel, count_parameters
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.precision.capability import GEMM_TIME_RATIO
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.context import gemm_time_ratio

GENERATOR = "experiments/compare_policies.py"
OVERHEADS_COMMAND = "python -m experiments.bench.overheads"
VALIDATE_COMMAND = "python -m experiments.validate_metrics --out docs/results/validation"
# Where the driver's report finds what it shares with every study (run from the repository root):
# the benchmark JSON and the metric validation sit in docs/, not beside each study's report.
OVERHEADS_JSON = Path("docs/overheads.json")
VALIDATION_DIR = Path("docs/results/validation")

DISCUSSION_FILE = "results_discussion.md"  # hand-written, next to the report; included verbatim
PLACEHOLDER = ("> **PLACEHOLDER - to be written from the numbers above, in {} next to this report.** "
               "This generated report states no conclusions.")


def report_files(report: Path) -> tuple[str, str]:
    """(figure-name prefix, discussion file) of a report: ``results.md`` has ``compare_*`` figures and
    ``results_discussion.md``; any other report ``X.md`` has ``X_*`` and ``X_discussion.md``, so two
    reports in one folder never overwrite each other's files."""
    if report.stem == "results":
        return "compare", DISCUSSION_FILE
    return report.stem, f"{report.stem}_discussion.md"


def _num(x: float | None, spec: str = ".4f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def plus_minus(mean: float, std: float, spec: str = ".4f", signed: bool = False) -> str:
    """``mean ± std`` in ``spec`` (mean with its sign when ``signed``); "—" for a missing value."""
    s = ("+" if signed else "") + spec
    return f"{_num(mean, s)} ± {_num(std, spec)}"


def _formats_label(fs) -> str:
    return "—" if fs is None else ",".join(fs)


def results_table(rows: Sequence[Row]) -> list[str]:
    lines = [("| policy | formats | rho | FP4 share (final plan) | seeds | final loss mean ± std | gap to BF16 | "
             "paired Δ vs BF16 (mean ± SE, pairs) |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = r.policy == "bf16" and r.formats is None
        lines.append(f"| {r.policy} | {_formats_label(r.formats)} | {_num(r.rho, 'g')} | {_num(r.fp4_share, '.3f')} | "
                     f"{r.n} | {plus_minus(r.mean, r.std)} | {'reference' if ref else _num(r.gap_pct, '+.2f') + '%'} | "
                     f"{'reference' if ref else plus_minus(r.paired_mean, standard_error(r.paired_std, r.n_pairs), signed=True) + f' ({r.n_pairs})'} |")
    return lines


def _share(results: Sequence[dict], policy: str | None, formats, rho) -> float | None:
    v = [r["fp4_share"] for r in results if r["policy"] == policy and fmt_key(r.get("formats")) == formats
         and r.get("rho") == rho and r.get("fp4_share") is not None]
    return float(np.mean(v)) if v else None


def sweep_table(results: Sequence[dict], p: Protocol, domain: str, best: Mapping[tuple[str, ...], str | None]) -> list[str]:
    """SNIP vs the best static baseline at each rho of the sweep (mean ± std over seeds, paired Δ ± SE)."""
    lines = [("| formats | rho | snip: FP4 share | snip: loss mean ± std | baseline | baseline: FP4 share | "
             "baseline: loss mean ± std | paired Δ snip − baseline (mean ± SE, pairs) |"),
             "|---|---|---|---|---|---|---|---|"]
    for fs in p.sweep_format_sets:
        base = best.get(fs)
        for rho in p.sweep_rhos:
            s = by_seed(results, "snip", fs, rho, domain)
            b = by_seed(results, base, fs, rho, domain) if base else {}
            if not s and not b:
                continue
            pm, ps, n = paired(s, b)
            s_mean = float(np.mean(list(s.values()))) if s else float("nan")
            b_mean = float(np.mean(list(b.values()))) if b else float("nan")
            lines.append(f"| {_formats_label(fs)} | {rho:g} | {_num(_share(results, 'snip', fs, rho), '.3f')} | "
                         f"{plus_minus(s_mean, sample_std(list(s.values())))} | {base or '—'} | "
                         f"{_num(_share(results, base, fs, rho), '.3f')} | {plus_minus(b_mean, sample_std(list(b.values())))} | "
                         f"{plus_minus(pm, standard_error(ps, n), signed=True)} ({n}) |")
    return lines


def standard_error(std: float, n: int) -> float:
    """Standard error of a mean of ``n`` values with sample std ``std`` (nan below 2)."""
    return std / math.sqrt(n) if n > 1 else float("nan")


def verdict(mean: float, se: float) -> str:
    """SNIP minus a baseline (lower loss is better): "wins" when the paired mean is below -2 SE,
    "loses" when above +2 SE, else "ties"; "—" without a standard error (fewer than 2 pairs)."""
    if not (math.isfinite(mean) and math.isfinite(se)):
        return "—"
    return "wins" if mean < -2 * se else "loses" if mean > 2 * se else "ties"


def snip_cells(results: Sequence[dict], p: Protocol) -> list[tuple[tuple[str, ...], float]]:
    """The (format set, rho) cells SNIP ran in: primary and sweep, in report order."""
    cells = [(fs, rho) for fs in p.format_sets for rho in p.rhos_of(fs)]
    cells += [(fs, rho) for fs in p.sweep_format_sets for rho in p.sweep_rhos]
    present = {(fmt_key(r.get("formats")), r.get("rho")) for r in results if r["policy"] == "snip"}
    return sorted((c for c in dict.fromkeys(cells) if c in present),
                  key=lambda c: (p.format_sets.index(c[0]) if c[0] in p.format_sets else len(p.format_sets), c[1]))


def snip_versus_section(results: Sequence[dict], p: Protocol) -> list[str]:
    """SNIP minus every other policy of the same (format set, rho) and every format-free policy,
    paired by seed: mean ± standard error of the paired differences, and a verdict per domain."""
    out = ["## SNIP against every policy, paired by seed", "",
           ("Δ = SNIP's final loss minus the other policy's, on the same seed (negative: SNIP better); "
            "mean ± standard error (sample std / √pairs) over the seeds both ran, (pairs). SNIP **wins** when "
            "Δ < −2 SE, **loses** when Δ > +2 SE, and otherwise **ties**."), ""]
    free = [pol for pol in dict.fromkeys(r["policy"] for r in results) if is_format_free(pol)]
    for fs, rho in snip_cells(results, p):
        others = free + [pol for pol in FORMAT_POLICIES if pol != "snip"]
        rows, sentences = [], []
        for domain in p.domains:
            snip = by_seed(results, "snip", fs, rho, domain)
            outcome: dict[str, list[str]] = {"wins": [], "ties": [], "loses": []}
            for pol in others:
                f, r = (None, None) if is_format_free(pol) else (fs, rho)
                pm, ps, n = paired(snip, by_seed(results, pol, f, r, domain))
                if n:
                    v = verdict(pm, standard_error(ps, n))
                    rows.append((pol, domain, f"{plus_minus(pm, standard_error(ps, n), signed=True)} ({n}) {v}"))
                    if v in outcome:
                        outcome[v].append(f"`{pol}`")
            joined = {"wins": "wins against", "ties": "ties with", "loses": "loses to"}
            said = [f"{joined[v]} {', '.join(pols)}" for v, pols in outcome.items() if pols]
            if said:
                sentences.append(f"- On {_domain_title(domain, p)}, SNIP " + "; ".join(said) + ".")
        if not rows:
            continue
        pols = list(dict.fromkeys(r[0] for r in rows))
        cell = {(pol, d): text for pol, d, text in rows}
        out += [f"### `{','.join(fs)}`, rho = {rho:g} (SNIP's FP4 share {_num(_share(results, 'snip', fs, rho), '.3f')})", "",
                "| SNIP − | FP4 share | " + " | ".join(f"`{d}`" for d in p.domains) + " |",
                "|---|---|" + "---|" * len(p.domains)]
        for pol in pols:
            f, r = (None, None) if is_format_free(pol) else (fs, rho)
            out.append(f"| {pol} | {_num(_share(results, pol, f, r), '.3f')} | "
                       + " | ".join(cell.get((pol, d), "—") for d in p.domains) + " |")
        out += ["", *sentences, ""]
    return out


def _domain_title(domain: str, p: Protocol) -> str:
    if domain == TRAIN_DOMAIN:
        return f"training domain: held-out documents of {p.train_corpus} (`val_loss`)"
    return f"other domain: {domain[len('val_loss_'):]} (`{domain}`)"


def overheads_section(path: Path) -> list[str]:
    """The benchmark's re-plan cost, emulation ratios and CP-SAT times, from its JSON (as recorded there)."""
    if not path.is_file():
        return [f"_Not measured yet: run `{OVERHEADS_COMMAND}` (writes {path.name})._"]
    d = json.loads(path.read_text())
    m = d.get("machine", {})
    load = (m.get("load_avg_at_start") or [None])[0]
    lines = [(f"From `{path.as_posix()}` (`{d.get('command', OVERHEADS_COMMAND)}`; "
             f"{m.get('torch_threads', '?')} torch thread(s), load average {_num(load, '.1f')} "
             f"at start, compiled quantizers: {d.get('compiled_quantizers', False)}):"), ""]
    rp = d.get("replan")
    if rp:
        lines += [(f"- SNIP re-plan on `{rp.get('model', '?')}`: {_num(rp.get('replan_s'), '.2f')} s "
                  f"(stats {_num(rp.get('stats_s'), '.2f')} s, metrics {_num(rp.get('metrics_s'), '.3f')} s, "
                  f"solve {_num(rp.get('solve_s'), '.3f')} s) = {_num(rp.get('replan_over_step'), '.1f')} training steps "
                  f"({_num(rp.get('step_s'), '.3f')} s each); at interval {rp.get('interval', '?')}: "
                  f"{_num(rp.get('pct_of_training_at_interval'), '.1f')}% of training time.")]
    em = d.get("emulation", {}).get("formats", {})
    if em:
        lines += ["", "| format (all GEMMs) | step s | ratio to BF16 |", "|---|---|---|"]
        for f, v in em.items():
            note = f" ({v['error']})" if "error" in v else ""
            lines.append(f"| {f} | {_num(v.get('step_s'), '.3f')} | {_num(v.get('ratio'), '.2f')}{note} |")
    ilp_rows = d.get("ilp", {}).get("rows", [])
    if ilp_rows:
        lines += ["", "| granularity | layers | units | status | CP-SAT solve s |", "|---|---|---|---|---|"]
        lines += [f"| {r['granularity']} | {r['layers']} | {r['units']} | {r['status']} | {_num(r['solve_s'], '.3f')} |"
                  for r in ilp_rows]
    return lines


def model_parameters(cfg: Config) -> int:
    """Parameters of the protocol's model (embedding and LM head included), counted on the meta
    device: the vocabulary is the tokenizer's, padded as the trainer pads it."""
    vocab = cfg.model.vocab_size or load_tokenizer_for(cfg.data).vocab_size
    with torch.device("meta"):
        return count_parameters(LlamaModel(cfg.model, vocab))


def _continued_lr(p: Protocol, cfg: Config) -> str:
    """How the continued runs' LR moves, in words."""
    t = cfg.training
    if p.continuation_schedule == "wsd":
        decay = max(1, round(t.wsd_decay_fraction * p.steps))
        return (f"the lr held at {t.lr:g} for {p.steps - decay} steps, then decaying linearly to {t.min_lr:g} over "
                f"the last {decay} (WSD, `training.wsd_decay_fraction` = {t.wsd_decay_fraction:g})")
    return f"the lr decaying ({t.lr_schedule}) from {t.lr:g} to {t.min_lr:g}"


def protocol_section(results: Sequence[dict], p: Protocol, all_records: Sequence[dict]) -> list[str]:
    """What every run shared: model, tokens, schedule, seeds, validation, statistics, sweep."""
    cfg = load_config(config_path(p), list(p.overrides))
    t, m = cfg.training, cfg.model
    tokens = p.steps * t.global_batch_size * t.seq_len
    wall = sum(r.get("wall_s", 0.0) for r in results)
    bases = [r for r in latest_records(all_records).values() if r.get("policy") == BASE_POLICY and r.get("status") == "ok"]
    spread = p.eval_windows == "spread"
    windows = ("windows spread evenly over the whole text, or every window of a smaller set" if spread
               else "the first windows of each")
    targets = "; ".join(f"`{','.join(fs)}` at rho = {', '.join(f'{r:g}' for r in p.rhos_of(fs))}" for fs in p.format_sets)
    out = [
        "## Protocol",
        "",
        (f"- Model: `{p.config}`{' with ' + ' '.join(f'`{o}`' for o in p.overrides) if p.overrides else ''}: "
         f"{m.num_layers} layers, d={m.hidden_size}, ffn {m.ffn_hidden_size}, {m.num_attention_heads} heads / "
         f"{m.num_kv_heads} KV, {_num(model_parameters(cfg) / 1e6, '.2f')}M parameters."),
        *([(f"- **Continued pretraining.** Per seed one BF16 base run of {p.base_steps} steps "
            f"({p.base_steps * t.global_batch_size * t.seq_len / 1e6:.2f}M tokens) at constant lr {t.lr:g} after "
            f"{t.warmup_steps} warmup steps, SNIP off: an intermediate checkpoint of a longer schedule, as the SNIP "
            f"paper continues TinyLlama's. Every run below starts from that seed's checkpoint - weights and AdamW "
            f"moments (`training.init_from`, `training.init_optimizer=true`) - and trains {p.steps} more steps with "
            f"{_continued_lr(p, cfg)} without a new warmup."
            + (f" Continuation order {p.continuation_order}: every continued run reads the training windows in "
               f"another order than its base seed's (`data.shuffle_seed` = {CONTINUATION_ORDER_STRIDE} x "
               f"{p.continuation_order} + seed), a replica of the comparison on the same bases."
               if p.continuation_order else ""))]
           if p.continued else []),
        (f"- Tokens: {p.steps} steps x {t.global_batch_size} sequences x {t.seq_len} tokens = {tokens / 1e6:.2f}M "
         f"training tokens per run{' after the base run' if p.continued else ''} (byte-level tokenizer: "
         f"`{cfg.data.tokenizer}`), lr {t.lr:g} ({'wsd' if p.continuation_schedule == 'wsd' else t.lr_schedule})."),
        (f"- Every run starts in BF16; the policy is applied at step {p.warmup} and re-planned every {p.interval} "
         f"steps (static policies give the same plan each time). "
         + (f"**GEMM-time target** (`snip.target=\"gemm_time\"`, `snip.time_costs` {list(p.time_costs)}: the "
            f"modeled GPU's linear-GEMM time per FLOP relative to BF16): the *rho* column is the budget, the plan's "
            f"modeled linear-GEMM time over the same GEMMs in BF16, for every policy that takes one, per candidate "
            f"format set: {targets}; `uniform:*` and `bf16` are references at their own time (uniform:fp8 = 0.5). "
            if p.target == "gemm_time" else
            f"FP4 target (share of linear-layer FLOPs in FP4) for every policy that takes one, per candidate "
            f"format set: {targets}. ")
         + "`bf16` and `uniform:*` do not depend on the candidates and run once per seed."),
        *([("- Fair baselines (`snip.fair_share=true`): the static rules are orders of protection, so every "
            + ("policy runs the same GEMM-time budget within one decision unit."
               if p.target == "gemm_time" else "policy runs the same FP4 share within one decision unit (the FP4 "
                                               "share column)."))]
          if cfg.snip.fair_share else []),
        (f"- Seeds {', '.join(map(str, p.seeds))} (`training.seed`: init, data order and which training "
         f"documents are held out for `val_loss`; `snip.seed` = the same seed)."),
        (f"- Validation: final loss over {'up to ' if spread else ''}{p.eval_batches} x {t.micro_batch_size} windows of {t.seq_len} tokens per "
         f"domain, evaluated in the run's final precision plan. Other domains (the headline): "
         f"{', '.join(f'`{c}`' for c in p.valid_corpora)} ({windows}, the same for every run). "
         f"Training domain: "
         f"held-out documents of `{p.train_corpus}`."),
        ("- Statistics: mean ± sample std (ddof=1) over seeds; gap to BF16 = relative difference of the means; "
         "paired Δ = mean over seeds of (run − BF16 run of the same seed) ± its standard error (sample std / "
         "√pairs)."),
        (f"- Sweep: `snip` against the best static baseline ({', '.join(STATIC_BASELINES)}), chosen per format set "
         f"by the lowest mean final `val_loss` on the **training-domain** held-out split at rho={p.rho:g} - not on "
         f"the other domains reported as the headline - at rho in {{{', '.join(f'{r:g}' for r in p.sweep_rhos)}}} "
         f"for {', '.join('`' + ','.join(fs) + '`' for fs in p.sweep_format_sets)}."
         if p.sweep_rhos and p.sweep_format_sets else "- Sweep: not run (--no-sweep)."),
        (f"- {len(results)} finished runs, {wall / 60:.0f} min of run wall time in all"
         + (f" (and {len(bases)} base runs, {sum(r.get('wall_s', 0.0) for r in bases) / 60:.0f} min)." if bases else ".")),
    ]
    failed = [r for r in latest_records(all_records).values() if r.get("status") != "ok"]
    if failed:
        names = ", ".join(f"{r['name']} ({r['status']})" for r in failed)
        out.append(f"- Failed or timed-out runs (not in the tables; see their train.log): {names}.")
    return out


def primary_section(results: Sequence[dict], p: Protocol) -> list[str]:
    """One results table per validation domain at the primary rhos of each format set, other domains first."""
    primary = [r for r in results if r.get("rho") is None
               or (fmt_key(r.get("formats")) in p.format_sets and r["rho"] in p.rhos_of(fmt_key(r["formats"])))]
    rhos = sorted({r for fs in p.format_sets for r in p.rhos_of(fs)})
    out = [f"## Primary comparison (rho = {', '.join(f'{r:g}' for r in rhos)})", ""]
    for domain in p.domains:
        rows = aggregate(primary, domain, p.format_sets)
        if rows:
            out += [f"### {_domain_title(domain, p)}", "", *results_table(rows), ""]
    return out


def curves_section(results: Sequence[dict], p: Protocol, docs: Path, prefix: str) -> list[str]:
    out = ["## Loss curves", ""]
    for fs in p.format_sets:
        png = plot_curves(results, p, fs, docs / "figures" / f"{prefix}_curves_{'-'.join(fs)}.png")
        if png:
            out += [f"![curves {','.join(fs)}]({png.relative_to(docs).as_posix()})", ""]
    return out


def sweep_section(results: Sequence[dict], p: Protocol) -> list[str]:
    best = {fs: best_static_baseline(results, fs, p.rho) for fs in p.sweep_format_sets}
    out = ["## rho sweep: SNIP vs the best static baseline", ""]
    if p.sweep_rhos and p.sweep_format_sets:
        out += [f"- Best static baseline by training-domain `val_loss` at rho={p.rho:g}: "
                + ", ".join(f"`{','.join(fs)}` -> {best[fs] or 'not determined (no primary results)'}" for fs in best), ""]
    else:
        out += ["_Not run (--no-sweep)._", ""]
    for domain in p.domains:
        tbl = sweep_table(results, p, domain, best)
        if len(tbl) > 2:
            out += [f"### {_domain_title(domain, p)}", "", *tbl, ""]
    return out


def modeled_time_ratio(plan_path: Path, cfg: Config, costs: Mapping[str, float]) -> float:
    """Modeled linear-GEMM time of the plan at ``plan_path`` over the same GEMMs in BF16, with
    relative per-FLOP ``costs`` (format -> time), each GEMM weighted by its linear's K*N."""
    entries = PrecisionPlan.load(plan_path).as_dict()
    return gemm_time_ratio(entries, linear_numel(model_linear_shapes(cfg.model)), costs)


def blackwell_costs(formats: Sequence[str]) -> dict[str, float]:
    """Per-FLOP GEMM time of ``formats`` on Blackwell relative to BF16 (GEMM_TIME_RATIO["Blackwell"]);
    a format Blackwell has no recipe for (``fp4_block``, a recipe variant) is priced as the native
    format of its width - the comparison's family stands in for a block-scaled FP4 that runs natively."""
    table = GEMM_TIME_RATIO["Blackwell"]
    return {f: table.get(f, table["nvfp4"] if f in FP4_FORMATS else table["fp8"]) for f in {"bf16", *formats}}


def plan_time_section(results: Sequence[dict], p: Protocol) -> list[str]:
    """Each policy's modeled linear-GEMM time over BF16, from its final plan (read from its run
    directory): under a GEMM-time target the plan's own ``gemm_time_ratio`` (the budget every policy
    meets within one unit); under an FP4-share target at Blackwell's ratios (``blackwell_costs``), so
    equal FP4 share can be told from equal GEMM time (a plan that protects in BF16 costs more)."""
    timed = p.target == "gemm_time"
    cfg = load_config(config_path(p), list(p.overrides))
    fmts = sorted({f for fs in p.format_sets for f in fs} | {"bf16"}
                  | {pol.split(":", 1)[1] for pol in p.policies if pol.startswith("uniform:")})
    costs = blackwell_costs(fmts)
    source = (f"with the modeled GPU's time costs {list(p.time_costs)} (`extra.gemm_time_ratio` of `plans/step_N.json`)"
              if timed else
              "at Blackwell's dense tensor-core ratios (`GEMM_TIME_RATIO[\"Blackwell\"]` of `precision/capability.py`; "
              "formats without a Blackwell recipe priced as the native format of their width: "
              + ", ".join(f"{f} {c:g}" for f, c in sorted(costs.items())) + ")")
    out = ["## Modeled GEMM time of the final plans", "",
           f"Linear-GEMM time of each run's final plan over the same GEMMs in BF16, {source}.", "",
           "| policy | formats | rho | runs | GEMM time / BF16 (min - max over seeds) |", "|---|---|---|---|---|"]
    groups: dict[tuple, list[float]] = {}
    for r in results:
        plan = Path(r.get("run_dir", "")) / r.get("final_plan", "-")
        if plan.is_file():
            ratio = (json.loads(plan.read_text()).get("extra", {}).get("gemm_time_ratio") if timed
                     else modeled_time_ratio(plan, cfg, costs))
            if ratio is not None:
                groups.setdefault((r["policy"], fmt_key(r.get("formats")), r.get("rho")), []).append(ratio)
    if not groups:
        return []
    for (pol, fs, rho), ratios in groups.items():
        out.append(f"| {pol} | {_formats_label(fs)} | {_num(rho, 'g')} | {len(ratios)} | "
                   f"{min(ratios):.4f} - {max(ratios):.4f} |")
    return out + [""]


def precision_maps_section(results: Sequence[dict], p: Protocol, docs: Path, prefix: str) -> list[str]:
    """SNIP's precision maps at its first and last re-plan (``plans/step_N.png``) and its timeline,
    for the first seed that has them, per format set at the primary rho; copied next to the report."""
    out = ["## SNIP's precision maps: first and last re-plan", ""]
    for fs in p.format_sets:
        rho = p.rho if p.rho in p.rhos_of(fs) else p.rhos_of(fs)[0]
        snip_runs = sorted((r for r in results if r["policy"] == "snip" and fmt_key(r.get("formats")) == fs
                            and r.get("rho") == rho), key=lambda r: r["seed"])
        for r in snip_runs:
            run_dir = Path(r["run_dir"])
            maps = sorted(run_dir.glob("plans/step_*[0-9].png"))
            maps = [m for m in maps if m.stem != "step_000000"]  # the initial (BF16) plan
            if not maps:
                continue
            label = f"{','.join(fs)} rho {rho:g} seed {r['seed']}"
            picks = [("first re-plan", maps[0]), ("last re-plan", maps[-1])] if len(maps) > 1 else [("re-plan", maps[0])]
            picks.append(("timeline", run_dir / "timeline.png"))
            for kind, src in picks:
                if src.is_file():
                    slug = kind.replace(" ", "_").replace("-", "")
                    dst = docs / "figures" / f"{prefix}_snip_{slug}_{'-'.join(fs)}_rho{rho:g}_seed{r['seed']}.png"
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
                    step = f" (step {int(src.stem.split('_')[1])})" if src.stem.startswith("step_") else ""
                    out += [f"![snip {kind}{step}, {label}]({dst.relative_to(docs).as_posix()})", ""]
            break  # one seed per format set
    return out


def cost_section(results: Sequence[dict], p: Protocol, overheads: Path) -> list[str]:
    """Per-group train / re-plan / wall seconds from the records, then the benchmark's overheads."""
    out = ["## Cost: re-plan time and emulation", ""]
    timing = [r for r in results if r.get("train_s")]
    if timing:
        out += [("Per run, from its metrics: train s = sum of step times (re-plans and evaluations excluded), "
                 "re-plan s = sum of the controller's re-plan times, wall s = the whole subprocess (start-up, "
                 "data, evaluations, compilation included)."), "",
                "| policy | formats | rho | runs | train s (mean) | re-plan s (mean) | re-plan / train | wall s (mean) |",
                "|---|---|---|---|---|---|---|---|"]
        for key in group_order(((r["policy"], fmt_key(r.get("formats")), r.get("rho")) for r in timing), p.format_sets):
            rs = [r for r in timing if (r["policy"], fmt_key(r.get("formats")), r.get("rho")) == key]
            tr, rp, wl = (float(np.mean([r.get(k, 0.0) for r in rs])) for k in ("train_s", "replan_s", "wall_s"))
            out.append(f"| {key[0]} | {_formats_label(key[1])} | {_num(key[2], 'g')} | {len(rs)} | {tr:.1f} | "
                       f"{rp:.1f} | {100 * rp / tr:.1f}% | {wl:.1f} |")
        out.append("")
    return out + overheads_section(overheads) + [""]


def validation_section(validation: Path) -> list[str]:
    """The metric validation's summary (``validation/summary.md``, written by ``experiments.validate_metrics``),
    one heading level down."""
    out = ["## Metric validation", ""]
    summary = validation / "summary.md"
    if summary.is_file():
        body = summary.read_text().strip().splitlines()
        return out + [("#" + line) if line.startswith("#") else line for line in body] + [""]
    return out + [f"_Not run yet: `{VALIDATE_COMMAND}` writes the summary._", ""]


def appendix_section(path: Path) -> list[str]:
    """An earlier report in the same folder (``--appendix``), included whole below this one with its
    headings one level down (its figure links are relative to that folder, so they stay valid)."""
    body = path.read_text().strip().splitlines()
    title = body[0].lstrip("# ").strip() if body and body[0].startswith("# ") else path.stem
    lines = [("#" + line) if line.startswith("#") else line for line in body[1:]]
    return [f"## Earlier: {title}", "", f"_Included from `{path.name}`, which keeps it as it was generated._", "",
            *lines, ""]


def write_report(results: Sequence[dict], p: Protocol, report: Path, *, command: str,
                 all_records: Sequence[dict] = (), appendix: Path | None = None,
                 overheads: Path | None = None, validation: Path | None = None) -> Path:
    """Write the markdown report (+ figures under ``<report dir>/figures/``) from ``results``;
    ``appendix``: an earlier report included at the end (``appendix_section``); ``overheads`` (the
    benchmark JSON) and ``validation`` (the metric validation's folder) default to ``overheads.json``
    and ``validation/`` beside the report (the driver passes ``OVERHEADS_JSON`` and ``VALIDATION_DIR``)."""
    docs = report.parent
    overheads = docs / "overheads.json" if overheads is None else overheads
    validation = docs / "validation" if validation is None else validation
    prefix, discussion_name = report_files(report)
    out = ["# Results: precision policies compared", "",
           f"Generated by `{GENERATOR}`; do not edit by hand. Command:", "", "```bash", command, "```", ""]
    out += protocol_section(results, p, all_records)
    out += [""] + primary_section(results, p)
    out += plan_time_section(results, p)
    out += snip_versus_section(results, p)
    out += curves_section(results, p, docs, prefix)
    out += sweep_section(results, p)
    out += precision_maps_section(results, p, docs, prefix)
    out += cost_section(results, p, overheads)
    out += validation_section(validation)
    # The conclusions are written by a person from the numbers above, in a file of their own, so
    # that regenerating the tables (a rerun, --report-only) never erases them.
    discussion = docs / discussion_name
    out += ["## What this shows", ""]
    out += [discussion.read_text().strip() if discussion.is_file() else PLACEHOLDER.format(discussion_name), ""]
    if appendix is not None:
        out += appendix_section(appendix)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(out))
    return report
