"""Policy comparison: train one model from the same seeds under each precision policy, then report.

    python -m experiments.compare_policies --dry-list      # planned runs + estimated time
    python -m experiments.compare_policies                 # run (resumable) and write docs/results/comparison/results.md
    python -m experiments.compare_policies --report-only   # rewrite the report from results.jsonl

Protocol (every option below has a default; ``--dry-list`` prints the resolved plan):

* **Model and tokens** (default): tiny.toml with 8 blocks, d=128, ffn 384 (1.66M parameters),
  8 x 128-token sequences per step, 500 steps = 0.51M tokens per run; 3 seeds; 54 runs.
  ``--dry-list`` estimates the wall time (what it took here: docs/results/comparison/results.md).
* **Policies** (``snip/policies.py``): ``bf16``, ``uniform:fp8``, ``uniform:nvfp4``,
  ``uniform:mxfp4`` - these do not depend on the candidate formats and run once per seed - and
  ``bf16_ends``, ``layer_type``, ``min_rel_err``, ``random``, ``snip``, which run once per
  candidate format set (default ``fp8,nvfp4`` and the harsher ``fp8,mxfp4``) at FP4 target
  ``--rho`` (0.75).
* **Same warmup for all.** Every run starts in BF16 (``precision.initial_plan=bf16``); the SNIP
  controller applies the policy at ``snip.warmup`` and re-plans every ``snip.interval`` steps
  (``snip.enabled=true snip.policy=<spec>``; static policies give the same plan each time).
* **Seeds** (``training.seed``: init and data order; ``snip.seed`` follows it, so ``random``
  draws a different plan per seed and the probes differ too).
* **Continued pretraining** (``--base-steps N``, the SNIP paper's setting): per seed one BF16 base
  run of N steps at constant LR (an intermediate checkpoint, kept in ``<out-dir>/base_seed<s>``);
  every policy then starts from it (weights and AdamW moments: ``training.init_from``,
  ``training.init_optimizer``) and trains ``--steps`` more with the LR decaying from its peak.
  A base whose checkpoint is not on this machine is trained again: bit for bit the same on a machine
  like the first, but another CPU (``machine`` in each record: PyTorch and its CPU capability) can train
  it to another base, and then the driver warns that the recorded continuations do not pair with new ones.
* **Rhos per format set**: ``--format-sets 'fp8_block,fp4_block@0.75,0.8;fp8,nvfp4@0.75,0.9'``
  runs every policy at each listed rho of its set. Runs go in order of importance: the first
  format set (with the format-free policies), then the sweep, then the other sets.
* **Sweep.** After the primary runs of the first format set: ``snip`` and the best *static* baseline (``bf16_ends``,
  ``layer_type`` or ``random`` with the lowest mean final ``val_loss`` on the *training-domain*
  held-out split, per format set) at each rho of ``--sweep-rhos`` (0.5, 0.75, 0.9), on
  ``--sweep-format-sets`` (default only the harsher ``fp8,mxfp4``, to fit the time).
* **Validation.** ``val_loss`` = held-out documents of the training corpus (the split depends on
  the seed); ``val_loss_<name>`` = other domains, the first ``--eval-batches`` x micro-batch
  windows of each, the same for every run; the report leads with them. By default the bundled
  Moby-Dick (``moby_dick``) and the Python docs (``python_docs``: ``corpus/python_docs.jsonl``,
  which ``python scripts/prepare_corpus.py --out corpus --corpus python_docs`` fetches by
  package name). ``--valid-corpus NAME=PATH`` (repeatable) points a domain at another file or
  adds one (NAME is the file's stem: the trainer logs ``val_loss_<stem>``); ``NAME=`` drops it.
  A missing file is an error before any run starts, never a domain silently left out.

Each training run is a subprocess (``python -m megatron_snip.train``) with a timeout, logging to
``<out-dir>/<run>/train.log``; when it ends, its ``metrics.jsonl`` is summarized into one JSON
line of ``<out-dir>/results.jsonl``.
A rerun skips runs whose latest record is ``ok`` with the same resolved configuration
(``same_config``: fields added to ``Config`` since, at their defaults, do not count), and
restarts any other run from scratch. The report (``--report``) is regenerated at the end of every
invocation.

The pieces live in ``experiments/comparison/``: ``protocol`` (run list and per-run config),
``runner`` (subprocesses), ``store`` (results.jsonl, resume), ``estimate`` (``--dry-list``),
``aggregate`` (statistics over seeds), ``report`` and ``figures`` (docs/results/comparison/results.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from experiments.comparison.estimate import CostModel, dry_list
from experiments.comparison.protocol import (
    CONTINUATION_ORDER_STRIDE,
    DEFAULT_SETS,
    DEFAULT_VALID_CORPORA,
    REPO,
    Protocol,
    base_run,
    config_path,
    primary_runs,
    sweep_runs,
)
from experiments.comparison.report import OVERHEADS_JSON, VALIDATION_DIR, write_report
from experiments.comparison.runner import run_all
from experiments.comparison.store import best_static_baseline, current_results, latest_records, read_results
from megatron_snip.config import load_config
from megatron_snip.config.values import parse_time_costs
from megatron_snip.data import indexed
from megatron_snip.data.pipeline import corpus_name
from megatron_snip.precision.capability import GPUS, gemm_time_costs


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _time_costs(text: str) -> tuple[str, ...]:
    """``'bf16=1,fp8_block=0.5'`` -> the ``snip.time_costs`` entries, checked by ``parse_time_costs``."""
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    try:
        parse_time_costs(entries)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return entries


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _format_sets(text: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(f.strip() for f in part.split(",") if f.strip()) for part in text.split(";") if part.strip())


def _format_sets_with_rhos(text: str) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[float, ...] | None, ...]]:
    """``'fp8_block,fp4_block@0.75,0.8;fp8,nvfp4'`` -> the format sets and, per set, its rhos (None: --rho)."""
    sets, rhos = [], []
    for part in (x for x in text.split(";") if x.strip()):
        formats, sep, rho_text = part.partition("@")
        sets += _format_sets(formats)
        rhos.append(_floats(rho_text) if sep else None)
    return tuple(sets), tuple(rhos)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Protocol()
    ap.add_argument("--config", default=d.config)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help=f"override for every run (model size, seq_len, lr, ...), repeatable; applied after the "
                         f"defaults {' '.join(DEFAULT_SETS)}")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--warmup", type=int, default=d.warmup, help="step the policy is first applied (snip.warmup)")
    ap.add_argument("--interval", type=int, default=d.interval, help="re-plan interval (snip.interval)")
    ap.add_argument("--seeds", type=_ints, default=d.seeds, help="comma-separated, e.g. 1,2,3")
    ap.add_argument("--rho", type=float, default=d.rho,
                    help="FP4 target of the primary comparison (the sweep's best static baseline and the figures "
                         "are chosen at it; it must be one of the first format set's rhos)")
    ap.add_argument("--format-sets", type=_format_sets_with_rhos, default=(d.format_sets, (None,) * len(d.format_sets)),
                    help="candidate sets, ';'-separated, each optionally with the rhos every policy runs at after "
                         "'@' (default 'fp8,nvfp4;fp8,mxfp4', both at --rho; e.g. "
                         "'fp8_block,fp4_block@0.75,0.8;fp8,nvfp4@0.75,0.9')")
    ap.add_argument("--target", choices=("fp4_share", "gemm_time"), default=d.target,
                    help="fp4_share (default): the numbers after '@' and --rho are FP4 shares; gemm_time: they are "
                         "GEMM-time budgets (modeled linear-GEMM time / BF16's on --gpu), and a format set needs no "
                         "FP4 format, e.g. --target gemm_time --gpu h100 --format-sets 'bf16,fp8@0.6' --rho 0.6")
    ap.add_argument("--gpu", default="", choices=("", *GPUS),
                    help="gemm_time: the GPU whose time costs the runs model (precision/capability.py "
                         "GEMM_TIME_RATIO, torch backend), passed to every run as snip.time_costs")
    ap.add_argument("--time-costs", type=_time_costs, default=(),
                    help="gemm_time: the modeled GPU's GEMM time per FLOP against BF16 given directly instead of "
                         "--gpu, comma-separated format=ratio for bf16 and every format of the sets, e.g. "
                         "'bf16=1,fp8_block=0.5,fp4_block=0.25' (Blackwell's dense ratios with the comparison's "
                         "fp4_block priced as the native FP4 it stands in for, as the reports price plans; --gpu "
                         "b200 prices it as emulated)")
    ap.add_argument("--base-steps", type=int, default=d.base_steps,
                    help="continued pretraining: per seed one BF16 base run of this many steps at constant LR, "
                         "then every policy continues from its checkpoint (weights and AdamW moments) for --steps "
                         "steps with the LR decaying from its peak; 0 (default): every run from scratch")
    ap.add_argument("--continuation-schedule", choices=("config", "wsd"), default=d.continuation_schedule,
                    help="the continued runs' LR schedule: the config's (default; tiny.toml: cosine) or wsd "
                         "(peak held, then linear decay over the last training.wsd_decay_fraction of the steps)")
    ap.add_argument("--continuation-order", type=int, default=d.continuation_order,
                    help="with --base-steps: K > 0 continues every base on another order of the training windows "
                         f"(data.shuffle_seed = {CONTINUATION_ORDER_STRIDE} K + seed), a replica of the comparison on the same bases; "
                         "0 (default): the seed's own order")
    ap.add_argument("--sweep-rhos", type=_floats, default=d.sweep_rhos)
    ap.add_argument("--sweep-format-sets", type=_format_sets, default=d.sweep_format_sets,
                    help="format sets of the rho sweep (default the harsher 'fp8,mxfp4')")
    ap.add_argument("--no-sweep", action="store_true", help="primary comparison only")
    ap.add_argument("--policies", type=lambda s: tuple(x for x in s.split(";") if x), default=d.policies,
                    help="';'-separated subset of the policies")
    ap.add_argument("--train-corpus", default=d.train_corpus, help="data.train_path (JSONL, indexed prefix, bundled:<name>)")
    ap.add_argument("--valid-corpus", dest="valid_corpora", action="append", default=[], metavar="NAME=PATH",
                    type=parse_valid_corpus,
                    help="other-domain validation corpus NAME (the file's stem) at PATH, repeatable; replaces "
                         "the default of that name, NAME= drops it (defaults: "
                         + ", ".join(f"{k}={v}" for k, v in DEFAULT_VALID_CORPORA.items()) + ")")
    ap.add_argument("--eval-interval", type=int, default=d.eval_interval)
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches)
    ap.add_argument("--eval-windows", choices=("first", "spread"), default=d.eval_windows,
                    help="which windows of each domain: the first --eval-batches x micro-batch ones, or that "
                         "many spread over the whole text (training.eval_windows)")
    ap.add_argument("--out-dir", default="runs/compare")
    ap.add_argument("--report", default="docs/results/comparison/results.md")
    ap.add_argument("--appendix", default=None, metavar="MD",
                    help="an earlier report in the --report folder, included at the end of this one (e.g. "
                         "docs/results/comparison/results_from_scratch.md)")
    ap.add_argument("--jobs", type=int, default=2, help="training processes at once")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each training process")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before one run is killed")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint")
    ap.add_argument("--step-time", type=float, default=0.19,
                    help="BF16 step time (s) of one job with --jobs running, for --dry-list's estimate "
                         "(default: measured for the default model, 1 thread, 2 jobs at once)")
    ap.add_argument("--overheads", default=None, metavar="JSON",
                    help="python -m experiments.bench.overheads output with emulation ratios and re-plan cost "
                         "for the estimate "
                         "(default: built-in measurements for the default model)")
    ap.add_argument("--dry-list", action="store_true", help="print the planned runs and the estimated time; run nothing")
    ap.add_argument("--report-only", action="store_true", help="write the report from results.jsonl; run nothing")
    return ap


def parse_valid_corpus(text: str) -> tuple[str, str]:
    """``NAME=PATH`` (or ``NAME=`` to drop a default) -> (name, path); the trainer logs the
    corpus as ``val_loss_<corpus_name(path)>``, so NAME must be that name."""
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--valid-corpus {text!r} must be NAME=PATH (e.g. python_docs=corpus/"
                                         f"python_docs.jsonl) or NAME= to drop a default")
    if path and corpus_name(path) != name:
        raise argparse.ArgumentTypeError(f"--valid-corpus {text!r}: the trainer logs {path!r} as "
                                         f"val_loss_{corpus_name(path)}; name it {corpus_name(path)}=... or rename "
                                         f"the file to {name}.jsonl")
    return name, path


def valid_corpora(chosen: list[tuple[str, str]]) -> tuple[str, ...]:
    """The defaults with each ``--valid-corpus NAME=PATH`` applied in order (new names after them)."""
    corpora = dict(DEFAULT_VALID_CORPORA)
    for name, path in chosen:
        if path:
            corpora[name] = path
        else:
            corpora.pop(name, None)
    return tuple(corpora.values())


def missing_corpora(p: Protocol) -> list[str]:
    """Validation corpora that are neither bundled nor a file or indexed prefix (paths relative to the
    repository, where the runs start)."""
    return [c for c in p.valid_corpora
            if not c.startswith("bundled:") and not (REPO / c).exists() and not indexed.exists(REPO / c)]


def protocol_from_args(args: argparse.Namespace) -> Protocol:
    valid = valid_corpora(args.valid_corpora)
    format_sets, set_rhos = args.format_sets
    format_rhos = () if all(r is None for r in set_rhos) else tuple(r or (args.rho,) for r in set_rhos)
    return Protocol(config=args.config, steps=args.steps, warmup=args.warmup, interval=args.interval,
                    seeds=args.seeds, rho=args.rho, format_sets=format_sets, format_rhos=format_rhos,
                    base_steps=args.base_steps, continuation_schedule=args.continuation_schedule,
                    continuation_order=args.continuation_order,
                    sweep_rhos=() if args.no_sweep else args.sweep_rhos,
                    sweep_format_sets=() if args.no_sweep else args.sweep_format_sets, policies=args.policies,
                    train_corpus=args.train_corpus, valid_corpora=valid,
                    eval_interval=args.eval_interval, eval_batches=args.eval_batches,
                    eval_windows=args.eval_windows,
                    overrides=DEFAULT_SETS + tuple(args.overrides), target=args.target,
                    time_costs=given_or_modeled_time_costs(args, format_sets))


def given_or_modeled_time_costs(args: argparse.Namespace, format_sets) -> tuple[str, ...]:
    """``--time-costs`` as given (each format of the sets priced) or ``--gpu``'s modeled ones; () for neither."""
    if args.time_costs and args.gpu:
        raise ValueError("give --gpu or --time-costs, not both (each sets snip.time_costs)")
    if not args.time_costs:
        return modeled_time_costs(args.gpu, format_sets) if args.gpu else ()
    priced = parse_time_costs(args.time_costs)
    missing = sorted({f for fs in format_sets for f in fs} - set(priced))
    if missing:
        raise ValueError(f"--time-costs {','.join(args.time_costs)!r} prices no {missing}; add "
                         f"'<format>=<ratio>' for each format of --format-sets")
    return args.time_costs


def modeled_time_costs(gpu: str, format_sets) -> tuple[str, ...]:
    """``snip.time_costs`` entries modeling ``gpu`` under the torch backend for every format of the sets."""
    formats = [f for fs in format_sets for f in fs]
    costs = gemm_time_costs("torch", formats, GPUS[gpu].sm)
    return tuple(f"{f}={t:g}" for f, t in costs.items())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "-m", "experiments.compare_policies", *(sys.argv[1:] if argv is None else argv)])
    out_dir = Path(args.out_dir)
    saved = out_dir / "protocol.json"
    try:
        if args.report_only and saved.is_file():
            # The report describes the runs that were made, whatever this invocation's options say.
            meta = json.loads(saved.read_text())
            command = meta.pop("command", command)
            p = Protocol.from_json_dict(meta)
        else:
            p = protocol_from_args(args)
        load_config(config_path(p), list(p.overrides)).validate()  # a bad --set fails here, not in 60 subprocesses
        if args.appendix and (not Path(args.appendix).is_file()
                              or Path(args.appendix).resolve().parent != Path(args.report).resolve().parent):
            raise ValueError(f"--appendix={args.appendix!r} must be an existing report in the folder of "
                             f"--report={args.report!r} (its figure links are relative to that folder)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results_path = out_dir / "results.jsonl"
    records = read_results(results_path)
    primary = primary_runs(p)
    if args.dry_list:
        best = {fs: best_static_baseline(current_results(p, records), fs, p.rho) for fs in p.sweep_format_sets}
        # Before the primary results exist the baseline is unknown; estimate it as bf16_ends.
        sweep = sweep_runs(p, {fs: b or "bf16_ends" for fs, b in best.items()})
        cost = CostModel(args.step_time)
        if args.overheads:
            cost = CostModel.from_overheads(Path(args.overheads), args.step_time)
        bases = [base_run(seed) for seed in p.seeds] if p.continued else []
        print(dry_list(bases + primary + sweep, p, cost, args.jobs, latest_records(records)))
        if any(b is None for b in best.values()):
            print("(sweep baseline shown as bf16_ends until the primary runs pick the best static baseline)")
        for path in missing_corpora(p):
            print(f"(validation corpus {path} does not exist yet; fetch it before running, see --valid-corpus)")
        return 0
    if not args.report_only:
        missing = missing_corpora(p)
        if missing:
            print(f"error: validation corpus {', '.join(missing)} does not exist; fetch the Python docs with "
                  f"`python scripts/prepare_corpus.py --out corpus --corpus python_docs`, point the domain at your "
                  f"copy with --valid-corpus NAME=PATH, or drop it with --valid-corpus NAME=", file=sys.stderr)
            return 2
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "protocol.json").write_text(json.dumps({"command": command, **p.to_json_dict()}, indent=1))
        kw = {"jobs": args.jobs, "threads": args.threads, "timeout_s": args.timeout, "keep_checkpoints": args.keep_checkpoints}
        # In order of importance, so that what a cut leaves undone matters least: the first format
        # set (with the format-free policies), the sweep, then the other format sets.
        first = [r for r in primary if r.formats in (None, p.format_sets[0])]
        run_all(first, p, out_dir, **kw)
        if p.sweep_rhos:
            best = {fs: best_static_baseline(current_results(p, read_results(results_path)), fs, p.rho)
                    for fs in p.sweep_format_sets}
            print(f"best static baseline (training-domain val_loss, rho={p.rho:g}): {best}")
            run_all(sweep_runs(p, best), p, out_dir, **kw)
        run_all([r for r in primary if r not in first], p, out_dir, **kw)
        records = read_results(results_path)
    appendix = Path(args.appendix) if args.appendix else None
    report = write_report(current_results(p, records), p, Path(args.report), command=command, all_records=records,
                          appendix=appendix, overheads=OVERHEADS_JSON, validation=VALIDATION_DIR)
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
