"""The comparison's markdown report (``docs/results.md``): protocol, tables per validation domain,
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
from experiments.comparison.protocol import STATIC_BASELINES, TRAIN_DOMAIN, Protocol, config_path, fmt_key
from experiments.comparison.store import best_static_baseline, latest_records
from megatron_snip.config import Config, load_config
from megatron_snip.data.pipeline import load_tokenizer_for
from megatron_snip.model.llama import LlamaModel, count_parameters

GENERATOR = "experiments/compare_policies.py"
OVERHEADS_COMMAND = "python -m experiments.bench.overheads"
VALIDATE_COMMAND = "python -m experiments.validate_metrics --out docs/validation"

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


def _pm(mean: float, std: float, spec: str = ".4f", signed: bool = False) -> str:
    s = ("+" if signed else "") + spec
    return f"{_num(mean, s)} ± {_num(std, spec)}"


def _formats_label(fs) -> str:
    return "—" if fs is None else ",".join(fs)


def results_table(rows: Sequence[Row]) -> list[str]:
    lines = [("| policy | formats | rho | FP4 share (final plan) | seeds | final loss mean ± std | gap to BF16 | "
             "paired Δ vs BF16 (mean ± std, pairs) |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = r.policy == "bf16" and r.formats is None
        lines.append(f"| {r.policy} | {_formats_label(r.formats)} | {_num(r.rho, 'g')} | {_num(r.fp4_share, '.3f')} | "
                     f"{r.n} | {_pm(r.mean, r.std)} | {'reference' if ref else _num(r.gap_pct, '+.2f') + '%'} | "
                     f"{'reference' if ref else _pm(r.paired_mean, r.paired_std, signed=True) + f' ({r.n_pairs})'} |")
    return lines


def _share(results: Sequence[dict], policy: str | None, formats, rho) -> float | None:
    v = [r["fp4_share"] for r in results if r["policy"] == policy and fmt_key(r.get("formats")) == formats
         and r.get("rho") == rho and r.get("fp4_share") is not None]
    return float(np.mean(v)) if v else None


def sweep_table(results: Sequence[dict], p: Protocol, domain: str, best: Mapping[tuple[str, ...], str | None]) -> list[str]:
    """SNIP vs the best static baseline at each rho of the sweep (mean ± std over seeds, paired Δ)."""
    lines = [("| formats | rho | snip: FP4 share | snip: loss mean ± std | baseline | baseline: FP4 share | "
             "baseline: loss mean ± std | paired Δ snip − baseline (mean ± std, pairs) |"),
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
                         f"{_pm(s_mean, sample_std(list(s.values())))} | {base or '—'} | "
                         f"{_num(_share(results, base, fs, rho), '.3f')} | {_pm(b_mean, sample_std(list(b.values())))} | "
                         f"{_pm(pm, ps, signed=True)} ({n}) |")
    return lines


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


def protocol_section(results: Sequence[dict], p: Protocol, all_records: Sequence[dict]) -> list[str]:
    """What every run shared: model, tokens, schedule, seeds, validation, statistics, sweep."""
    cfg = load_config(config_path(p), list(p.overrides))
    t, m = cfg.training, cfg.model
    tokens = p.steps * t.global_batch_size * t.seq_len
    wall = sum(r.get("wall_s", 0.0) for r in results)
    out = [
        "## Protocol",
        "",
        (f"- Model: `{p.config}`{' with ' + ' '.join(f'`{o}`' for o in p.overrides) if p.overrides else ''}: "
         f"{m.num_layers} layers, d={m.hidden_size}, ffn {m.ffn_hidden_size}, {m.num_attention_heads} heads / "
         f"{m.num_kv_heads} KV, {_num(model_parameters(cfg) / 1e6, '.2f')}M parameters."),
        (f"- Tokens: {p.steps} steps x {t.global_batch_size} sequences x {t.seq_len} tokens = {tokens / 1e6:.2f}M "
         f"training tokens per run (byte-level tokenizer: `{cfg.data.tokenizer}`), lr {t.lr:g} ({t.lr_schedule})."),
        (f"- Every run starts in BF16; the policy is applied at step {p.warmup} and re-planned every {p.interval} "
         f"steps (static policies give the same plan each time). FP4 target rho = {p.rho:g} for every policy that "
         f"takes one; candidate format sets: {', '.join('`' + ','.join(fs) + '`' for fs in p.format_sets)}. "
         f"`bf16` and `uniform:*` do not depend on the candidates and run once per seed."),
        (f"- Seeds {', '.join(map(str, p.seeds))} (`training.seed`: init, data order and which training "
         f"documents are held out for `val_loss`; `snip.seed` = the same seed)."),
        (f"- Validation: final loss over {p.eval_batches} x {t.micro_batch_size} windows of {t.seq_len} tokens per "
         f"domain, evaluated in the run's final precision plan. Other domains (the headline): "
         f"{', '.join(f'`{c}`' for c in p.valid_corpora)} (the first windows of each, the same for every run). "
         f"Training domain: "
         f"held-out documents of `{p.train_corpus}`."),
        ("- Statistics: mean ± sample std (ddof=1) over seeds; gap to BF16 = relative difference of the means; "
         "paired Δ = mean and sample std over seeds of (run − BF16 run of the same seed)."),
        (f"- Sweep: `snip` against the best static baseline ({', '.join(STATIC_BASELINES)}), chosen per format set "
         f"by the lowest mean final `val_loss` on the **training-domain** held-out split at rho={p.rho:g} - not on "
         f"the other domains reported as the headline - at rho in {{{', '.join(f'{r:g}' for r in p.sweep_rhos)}}} "
         f"for {', '.join('`' + ','.join(fs) + '`' for fs in p.sweep_format_sets)}."
         if p.sweep_rhos and p.sweep_format_sets else "- Sweep: not run (--no-sweep)."),
        f"- {len(results)} finished runs, {wall / 60:.0f} min of run wall time in all.",
    ]
    failed = [r for r in latest_records(all_records).values() if r.get("status") != "ok"]
    if failed:
        names = ", ".join(f"{r['name']} ({r['status']})" for r in failed)
        out.append(f"- Failed or timed-out runs (not in the tables; see their train.log): {names}.")
    return out


def primary_section(results: Sequence[dict], p: Protocol) -> list[str]:
    """One results table per validation domain at the primary rho, other domains first."""
    primary = [r for r in results if r.get("rho") in (None, p.rho)]
    out = [f"## Primary comparison (rho = {p.rho:g})", ""]
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


def precision_maps_section(results: Sequence[dict], p: Protocol, docs: Path, prefix: str) -> list[str]:
    """The final precision map and timeline of one SNIP seed per format set, copied next to the report."""
    out = ["## Final SNIP precision maps", ""]
    for fs in p.format_sets:
        snip_runs = sorted((r for r in results if r["policy"] == "snip" and fmt_key(r.get("formats")) == fs
                            and r.get("rho") == p.rho), key=lambda r: r["seed"])
        for r in snip_runs:
            for kind in ("precision_map", "timeline"):
                src = Path(r["run_dir"]) / f"{kind}.png"
                if src.is_file():
                    dst = docs / "figures" / f"{prefix}_snip_{kind}_{'-'.join(fs)}_seed{r['seed']}.png"
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
                    out += [f"![{kind} snip {','.join(fs)} seed {r['seed']}]({dst.relative_to(docs).as_posix()})", ""]
            if (Path(r["run_dir"]) / "precision_map.png").is_file():
                break  # one seed's map per format set
    return out


def cost_section(results: Sequence[dict], p: Protocol, docs: Path) -> list[str]:
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
    return out + overheads_section(docs / "overheads.json") + [""]


def validation_section(docs: Path) -> list[str]:
    """The metric validation's summary (written by ``experiments.validate_metrics``), one heading level down."""
    out = ["## Metric validation", ""]
    summary = docs / "validation" / "summary.md"
    if summary.is_file():
        body = summary.read_text().strip().splitlines()
        return out + [("#" + line) if line.startswith("#") else line for line in body] + [""]
    return out + [f"_Not run yet: `{VALIDATE_COMMAND}` writes the summary._", ""]


def write_report(results: Sequence[dict], p: Protocol, report: Path, *, command: str,
                 all_records: Sequence[dict] = ()) -> Path:
    """Write the markdown report (+ figures under ``<report dir>/figures/``) from ``results``."""
    docs = report.parent
    prefix, discussion_name = report_files(report)
    out = ["# Results: precision policies compared", "",
           f"Generated by `{GENERATOR}`; do not edit by hand. Command:", "", "```bash", command, "```", ""]
    out += protocol_section(results, p, all_records)
    out += [""] + primary_section(results, p)
    out += curves_section(results, p, docs, prefix)
    out += sweep_section(results, p)
    out += precision_maps_section(results, p, docs, prefix)
    out += cost_section(results, p, docs)
    out += validation_section(docs)
    # The conclusions are written by a person from the numbers above, in a file of their own, so
    # that regenerating the tables (a rerun, --report-only) never erases them.
    discussion = docs / discussion_name
    out += ["## What this shows", ""]
    out += [discussion.read_text().strip() if discussion.is_file() else PLACEHOLDER.format(discussion_name), ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(out))
    return report
