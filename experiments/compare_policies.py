"""Policy comparison: train one model from the same seeds under each precision policy, then report.

    python scripts/compare_policies.py --dry-list                 # planned runs + estimated time
    python scripts/compare_policies.py                            # run (resumable) and write docs/results.md
    python scripts/compare_policies.py --report-only              # rewrite the report from results.jsonl

Protocol (every option below has a default; ``--dry-list`` prints the resolved plan):

* **Model and tokens** (default): tiny.toml with 8 blocks, d=128, ffn 384 (1.66M parameters),
  8 x 128-token sequences per step, 500 steps = 0.51M tokens per run; 3 seeds; 54 runs.
  Measured on 2 CPU cores with two 1-thread jobs and compiled quantizers (tiny.toml's default):
  70 min wall for all 54 runs; with eager quantizers about 3x longer. ``--dry-list`` estimates it.
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
* **Sweep.** After the primary runs: ``snip`` and the best *static* baseline (``bf16_ends``,
  ``layer_type`` or ``random`` with the lowest mean final ``val_loss`` on the *training-domain*
  held-out split, per format set) at each rho of ``--sweep-rhos`` (0.5, 0.75, 0.9), on
  ``--sweep-format-sets`` (default only the harsher ``fp8,mxfp4``, to fit the time).
* **Validation.** ``val_loss`` = held-out documents of the training corpus (the split depends on
  the seed); ``val_loss_<name>`` = other domains: bundled Moby-Dick and ``--valid-corpus``
  files (default /work/shared/data/python_docs.jsonl if it exists), the first
  ``--eval-batches`` x micro-batch windows of each, the same for every run. The report leads
  with the other domains.

Each training run is a subprocess (``python -m megatron_snip.train``) with a timeout, logging to
``<out-dir>/<run>/train.log``; when it ends, one JSON line goes to ``<out-dir>/results.jsonl``.
A rerun skips runs whose latest record is ``ok`` with the same resolved configuration
(``same_config``: fields added to ``Config`` since, at their defaults, do not count), and
restarts any other run from scratch. The report (``--report``) is regenerated at the end of every
invocation.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # plot_run's readers; scripts/ is not a package
sys.path.insert(0, str(REPO))

from plot_run import load_run  # scripts/plot_run.py: the metrics.jsonl reader

from megatron_snip.config import Config, load_config, parse_override
from megatron_snip.data.pipeline import corpus_name
from megatron_snip.precision.formats import FORMATS, FP4_FORMATS
from megatron_snip.snip.policies import parse_policy

FORMAT_FREE_POLICIES = ("bf16", "uniform:fp8", "uniform:nvfp4", "uniform:mxfp4")
FORMAT_POLICIES = ("bf16_ends", "layer_type", "min_rel_err", "random", "snip")
STATIC_BASELINES = ("bf16_ends", "layer_type", "random")  # candidates for the sweep's "best static baseline"
DEFAULT_FORMAT_SETS = (("fp8", "nvfp4"), ("fp8", "mxfp4"))
TRAIN_DOMAIN = "val_loss"
PYTHON_DOCS = "/work/shared/data/python_docs.jsonl"
# The default model and batch (on top of tiny.toml): 8 blocks so that bf16_ends at rho=0.75 is a
# real recipe (first and last block high precision = exactly 75% FP4; with tiny's 4 blocks it
# degenerates to all-FP4), d=128 and 128-token sequences so that 54 runs of 500 steps fit in
# ~90 min on 2 CPU cores (--dry-list prints the estimate; the report to the lead has the measurements).
DEFAULT_SETS = ("model.num_layers=8", "model.hidden_size=128", "model.ffn_hidden_size=384",
                "training.seq_len=128", "training.micro_batch_size=8", "training.global_batch_size=8")
# Keys the driver sets per run; a user --set on them would silently break pairing or resume.
DRIVER_KEYS = frozenset({
    "training.seed", "training.run_dir", "training.max_steps", "training.resume", "training.progress",
    "training.log_interval", "training.eval_interval", "training.eval_batches", "precision.initial_plan",
    "snip.enabled", "snip.policy", "snip.fp4_target", "snip.formats", "snip.warmup", "snip.interval", "snip.seed",
    "data.train_path", "data.valid_paths",
})


# ======================================================================================
# The protocol and the run list
# ======================================================================================
@dataclass(frozen=True)
class Protocol:
    """Everything that is the same for every run of one comparison."""

    config: str = "launch/configs/tiny.toml"
    steps: int = 500
    warmup: int = 50
    interval: int = 100
    seeds: tuple[int, ...] = (1, 2, 3)
    rho: float = 0.75
    format_sets: tuple[tuple[str, ...], ...] = DEFAULT_FORMAT_SETS
    sweep_rhos: tuple[float, ...] = (0.5, 0.75, 0.9)
    sweep_format_sets: tuple[tuple[str, ...], ...] = (("fp8", "mxfp4"),)
    policies: tuple[str, ...] = FORMAT_FREE_POLICIES + FORMAT_POLICIES
    train_corpus: str = "bundled:sotu"
    valid_corpora: tuple[str, ...] = ("bundled:moby_dick",)
    eval_interval: int = 100
    eval_batches: int = 8
    overrides: tuple[str, ...] = DEFAULT_SETS  # applied to every run before the driver's own --set

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ValueError(f"--steps={self.steps} must be > 0")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup={self.warmup} must be in [0, --steps={self.steps}) so the policy is applied")
        if self.interval <= 0:
            raise ValueError(f"--interval={self.interval} must be > 0")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds={list(self.seeds)} must be distinct integers, e.g. 1,2,3")
        for name, r in [("--rho", self.rho), *(("--sweep-rhos", r) for r in self.sweep_rhos)]:
            if not 0.0 < r <= 1.0:
                raise ValueError(f"{name}={r} must be in (0, 1] (a share of linear-layer FLOPs in FP4)")
        if not self.format_sets:
            raise ValueError("--format-sets is empty; give at least one candidate set, e.g. 'fp8,mxfp4'")
        for fs in self.format_sets + self.sweep_format_sets:
            bad = [f for f in fs if f not in FORMATS]
            if bad or not any(f in FP4_FORMATS for f in fs) or len(set(fs)) != len(fs):
                raise ValueError(f"format set {','.join(fs)!r} must list distinct formats from {sorted(FORMATS)} "
                                 f"including an FP4 one, e.g. fp8,mxfp4")
        for p in self.policies:
            parse_policy(p)  # ValueError naming the spec forms
            if p not in FORMAT_FREE_POLICIES and p not in FORMAT_POLICIES:
                raise ValueError(f"--policies entry {p!r} is not part of this comparison; choose from "
                                 f"{list(FORMAT_FREE_POLICIES + FORMAT_POLICIES)}")
        names = [corpus_name(p) for p in self.valid_corpora]
        if len(set(names)) != len(names) or "valid" in names:
            raise ValueError(f"--valid-corpus names {names} must be distinct and not 'valid' (each is logged as "
                             f"val_loss_<file stem>); rename a file")
        if self.eval_interval <= 0 or self.eval_batches <= 0:
            raise ValueError(f"--eval-interval={self.eval_interval} and --eval-batches={self.eval_batches} must be > 0")
        for ov in self.overrides:
            section, key, _ = parse_override(ov)
            if f"{section}.{key}" in DRIVER_KEYS:
                raise ValueError(f"--set {ov!r}: {section}.{key} is set by the driver per run; use its own option "
                                 f"(--steps, --warmup, --interval, --seeds, --rho, --train-corpus, ...)")

    @property
    def domains(self) -> tuple[str, ...]:
        """Metric keys of the validation sets: other domains first (the headline), training domain last."""
        return tuple(f"val_loss_{corpus_name(p)}" for p in self.valid_corpora) + (TRAIN_DOMAIN,)

    def to_json_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json_dict(cls, d: Mapping) -> Protocol:
        tuples = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) for k, v in d.items() if isinstance(v, list)}
        return cls(**{**d, **tuples})


@dataclass(frozen=True)
class RunSpec:
    """One training run. ``formats``/``rho`` are None for policies that do not depend on them."""

    seed: int
    policy: str
    formats: tuple[str, ...] | None = None
    rho: float | None = None
    group: str = field(default="primary", compare=False)  # "primary" or "sweep" (report section)

    @property
    def key(self) -> tuple:
        return (self.policy, self.formats, self.rho, self.seed)

    @property
    def name(self) -> str:
        """Run directory name, e.g. ``snip_fp8-mxfp4_rho0.75_seed1`` or ``uniform-nvfp4_seed2``."""
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", self.policy)
        if self.formats is None:
            return f"{slug}_seed{self.seed}"
        return f"{slug}_{'-'.join(self.formats)}_rho{self.rho:g}_seed{self.seed}"


def primary_runs(p: Protocol) -> list[RunSpec]:
    """The primary comparison: format-free policies once per seed, the others once per format set.

    Ordered seed-major, so an interrupted sweep leaves whole seeds (paired comparisons) done.
    """
    runs = []
    for seed in p.seeds:
        runs += [RunSpec(seed, pol) for pol in FORMAT_FREE_POLICIES if pol in p.policies]
        runs += [RunSpec(seed, pol, fs, p.rho) for fs in p.format_sets for pol in FORMAT_POLICIES if pol in p.policies]
    return runs


def sweep_runs(p: Protocol, best_static: Mapping[tuple[str, ...], str | None]) -> list[RunSpec]:
    """``snip`` and the best static baseline at every rho of the sweep, minus the primary runs.

    ``best_static[formats]`` is the baseline policy for that format set (None: not known yet,
    e.g. before the primary runs finished; then only ``snip`` is listed).
    """
    primary = {r.key for r in primary_runs(p)}
    runs = []
    for seed in p.seeds:
        for fs in p.sweep_format_sets:
            for pol in dict.fromkeys(x for x in ("snip", best_static.get(fs)) if x):
                for rho in p.sweep_rhos:
                    spec = RunSpec(seed, pol, fs, rho, group="sweep")
                    if spec.key not in primary:
                        runs.append(spec)
    return runs


def run_overrides(spec: RunSpec, p: Protocol, run_dir: Path) -> list[str]:
    """The ``--set`` list of one run: the user's overrides, then the driver's (which win)."""
    if spec.formats is not None:
        formats, rho = spec.formats, spec.rho
    else:
        # Format-free policies ignore the candidates; the controller still checks them, so give a
        # set that contains the run's own FP4 format (if any) and the primary rho.
        fmt = spec.policy.split(":", 1)[1] if spec.policy.startswith("uniform:") else None
        formats = ("fp8", fmt) if fmt in FP4_FORMATS else p.format_sets[0]
        rho = p.rho
    valid = "[" + ", ".join(json.dumps(v) for v in p.valid_corpora) + "]"
    return [*p.overrides,
            f"training.max_steps={p.steps}", f"training.seed={spec.seed}", f"training.run_dir={json.dumps(str(run_dir))}",
            "training.resume=false", "training.progress=false", "training.log_interval=1",
            f"training.eval_interval={p.eval_interval}", f"training.eval_batches={p.eval_batches}",
            "precision.initial_plan=bf16", "snip.enabled=true", f"snip.policy={json.dumps(spec.policy)}",
            f"snip.fp4_target={rho}", "snip.formats=[" + ", ".join(json.dumps(f) for f in formats) + "]",
            f"snip.warmup={p.warmup}", f"snip.interval={p.interval}", f"snip.seed={spec.seed}",
            f"data.train_path={json.dumps(p.train_corpus)}", f"data.valid_paths={valid}"]


def config_path(p: Protocol) -> Path:
    """``p.config`` as given, else relative to the repository (where the runs start)."""
    path = Path(p.config)
    return path if path.is_file() or path.is_absolute() else REPO / path


def resolved_config(spec: RunSpec, p: Protocol) -> dict[str, dict[str, Any]]:
    """Identity of a run's configuration, as its record stores it: the resolved config (file +
    overrides, the run dir left out) as {section: {field: value}}, JSON-normalized."""
    cfg = load_config(config_path(p), run_overrides(spec, p, Path("RUN_DIR")))
    return json.loads(json.dumps(cfg.to_dict()))


_DEFAULTS = json.loads(json.dumps(Config().to_dict()))


def same_config(recorded: Mapping[str, Mapping[str, Any]] | None, current: Mapping[str, Mapping[str, Any]]) -> bool:
    """Was a recorded run made with the ``current`` configuration? Every field the record has
    must be equal (so a changed value or default makes the run stale, an edited comment does
    not), and a field it lacks must be at its default: it was added to ``Config`` after the
    run, and a new field's default keeps the old behaviour. A recorded field that no longer
    exists makes the run stale."""
    if not recorded:
        return False
    if any(key not in current.get(section, {}) for section, values in recorded.items() for key in values):
        return False
    return all(recorded.get(section, {}).get(key, _DEFAULTS[section][key]) == value
               for section, values in current.items() for key, value in values.items())


# ======================================================================================
# Results: reading, resume decisions, best static baseline
# ======================================================================================
def read_results(path: Path) -> list[dict]:
    """All records of ``results.jsonl`` in file order.

    A line that is not a JSON record (a write torn by a killed driver) is skipped with a
    warning: its run then counts as not done and is trained again.
    """
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict) or "name" not in rec:
            print(f"warning: {path}:{i} is not a results record; ignoring it", file=sys.stderr)
            continue
        out.append(rec)
    return out


def append_record(path: Path, rec: dict) -> None:
    """Append one JSON line; start a new line first if the file ends in a torn one."""
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(rec) + "\n").encode())


def latest_records(records: Iterable[dict]) -> dict[str, dict]:
    """Run name -> its latest record (a rerun appends a newer one)."""
    out: dict[str, dict] = {}
    for r in records:
        out[r["name"]] = r
    return out


def is_done(spec: RunSpec, p: Protocol, latest: Mapping[str, dict]) -> bool:
    """True if ``spec`` finished ok under the same configuration (a rerun skips it)."""
    rec = latest.get(spec.name)
    return rec is not None and rec.get("status") == "ok" and same_config(rec.get("config"), resolved_config(spec, p))


def current_results(p: Protocol, records: Iterable[dict]) -> list[dict]:
    """Latest ok records of this protocol's runs (stale configurations and failures left out)."""
    latest = latest_records(records)
    specs = {r.name: r for r in primary_runs(p)}
    for base in STATIC_BASELINES:  # whichever baseline the sweep picked
        specs.update({r.name: r for r in sweep_runs(p, dict.fromkeys(p.sweep_format_sets, base))})
    return [rec for name, rec in latest.items() if name in specs and is_done(specs[name], p, latest)]


def _fmt_key(formats) -> tuple[str, ...] | None:
    return None if formats is None else tuple(formats)


def best_static_baseline(results: Iterable[dict], formats: tuple[str, ...], rho: float,
                         metric: str = TRAIN_DOMAIN) -> str | None:
    """The static baseline with the lowest mean final ``metric`` over seeds at (formats, rho).

    Selection uses the training-domain held-out split by design: the other domains are the
    reported outcome, so choosing on them would bias the comparison in the baseline's favour.
    """
    means = {}
    for pol in STATIC_BASELINES:
        vals = [r["final"][metric] for r in results if r["policy"] == pol and _fmt_key(r.get("formats")) == formats
                and r.get("rho") == rho and metric in r.get("final", {})]
        if vals:
            means[pol] = float(np.mean(vals))
    return min(means, key=means.__getitem__) if means else None


# ======================================================================================
# Running one training subprocess
# ======================================================================================
def parse_run_dir(run_dir: Path) -> dict:
    """Final validation losses, FP4 shares and timings from a finished run's ``metrics.jsonl``
    (read by ``plot_run.load_run``).

    train_s sums the per-step ``step_time_s`` (logged every step with ``log_interval=1``);
    replan_s sums the controller's ``replan_replan_total_s`` (statistics + metrics + solve + apply).
    """
    series = load_run(run_dir).series

    def values(key: str) -> list[float]:
        return series.get(key, ([], []))[1]

    final = {}
    for key in series:  # the latest finite evaluation (at the last step when the run finished)
        finite = [v for v in values(key) if math.isfinite(v)]
        if key.startswith("val_loss") and finite:
            final[key] = finite[-1]
    shares, replan = values("fp4_share"), values("replan_replan_total_s")
    out = {"final": final, "last_step": max((steps[-1] for steps, _ in series.values() if steps), default=0),
           "train_s": sum(values("step_time_s")), "replan_s": sum(replan), "replans": len(replan),
           "fp4_share": shares[-1] if shares else None,
           "fp4_share_mean": float(np.mean(shares)) if shares else None,
           "skipped_steps": int(max(values("skipped_steps"), default=0))}
    plans = sorted((run_dir / "plans").glob("step_*[0-9].json")) if (run_dir / "plans").is_dir() else []
    if plans:
        out["final_plan"] = str(plans[-1].relative_to(run_dir))
    return out


def train_command(p: Protocol, overrides: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_snip.train", "--config", str(config_path(p))]
    for ov in overrides:
        cmd += ["--set", ov]
    return cmd


def execute(spec: RunSpec, p: Protocol, out_dir: Path, *, threads: int, timeout_s: float,
            keep_checkpoints: bool = False) -> dict:
    """Train ``spec`` in a fresh ``out_dir/<name>`` as a subprocess; returns its results record."""
    run_dir = out_dir / spec.name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a partial or stale run: start over (the trainer would append to it)
    run_dir.mkdir(parents=True)
    cmd = train_command(p, run_overrides(spec, p, run_dir))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    rec = {"name": spec.name, "policy": spec.policy, "formats": None if spec.formats is None else list(spec.formats),
           "rho": spec.rho, "seed": spec.seed, "group": spec.group, "steps": p.steps, "threads": threads,
           "config": resolved_config(spec, p), "command": shlex.join(cmd), "run_dir": str(run_dir)}
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        log.write(rec["command"] + "\n\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the trainer and anything it started
            rc = proc.wait()
            status = "timeout"
    rec.update(returncode=rc, wall_s=time.perf_counter() - t0, finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    log_text = (run_dir / "train.log").read_text(errors="replace")
    m = re.search(r"model: ([0-9.]+)M parameters", log_text)
    rec["params_m"] = float(m.group(1)) if m else None
    if (run_dir / "metrics.jsonl").is_file():
        try:
            rec.update(parse_run_dir(run_dir))
        except ValueError as e:  # a corrupt metrics.jsonl: the run counts as failed, the driver goes on
            status, rec["parse_error"] = "failed", str(e)
    if status == "ok" and rec.get("last_step") != p.steps:
        status = "failed"  # exited 0 without reaching max_steps: not a result
    rec["status"] = status
    if status != "ok":
        rec["log_tail"] = log_text[-2000:]
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~40 MB each for tiny; not needed here
    return rec


def run_all(specs: Sequence[RunSpec], p: Protocol, out_dir: Path, *, jobs: int, threads: int, timeout_s: float,
            keep_checkpoints: bool = False, log=print) -> list[dict]:
    """Run every spec not already done (``jobs`` at a time); append each record as it finishes."""
    results_path = out_dir / "results.jsonl"
    latest = latest_records(read_results(results_path))
    todo = [s for s in specs if not is_done(s, p, latest)]
    if len(todo) < len(specs):
        log(f"skipping {len(specs) - len(todo)} finished run(s)")
    lock = threading.Lock()
    done: list[dict] = []

    def one(spec: RunSpec) -> dict:
        rec = execute(spec, p, out_dir, threads=threads, timeout_s=timeout_s, keep_checkpoints=keep_checkpoints)
        with lock:
            append_record(results_path, rec)
            done.append(rec)
            losses = " ".join(f"{k}={v:.4f}" for k, v in rec.get("final", {}).items())
            log(f"[{len(done)}/{len(todo)}] {spec.name}: {rec['status']} in {rec['wall_s']:.0f}s {losses}")
        return rec

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, todo))
    return done


# ======================================================================================
# Time estimate
# ======================================================================================
@dataclass(frozen=True)
class CostModel:
    """Seconds per run, for ``--dry-list``: startup + steps x step time x emulation factor + re-plans + evals.

    ``step_s`` is the BF16 step time of one job while ``jobs`` run at once. Emulation factors
    and the re-plan cost come from docs/overheads.json (scripts/bench_overheads.py) when present.
    """

    step_s: float
    startup_s: float = 10.0
    # Measured in the default comparison (docs/results.md, compiled quantizers, two 1-thread jobs on
    # 2 cores): mean train seconds of the uniform runs over the BF16 runs' 95 s, and ~6 s per re-plan.
    emulation: Mapping[str, float] = field(default_factory=lambda: {"bf16": 1.0, "fp8": 1.30, "nvfp4": 1.64, "mxfp4": 1.41})
    replan_steps: float = 32.0  # one statistics re-plan, in BF16 training steps (same measurement)
    eval_step_fraction: float = 0.33  # one eval micro-batch forward, in training steps

    def run_s(self, spec: RunSpec, p: Protocol) -> float:
        if spec.policy == "bf16":
            shares = {"bf16": 1.0}
        elif spec.policy.startswith("uniform:"):
            shares = {spec.policy.split(":", 1)[1]: 1.0}
        else:
            fs = spec.formats or p.format_sets[0]
            fp4 = next(f for f in fs if f in FP4_FORMATS)
            high = next((f for f in fs if f not in FP4_FORMATS), "bf16")
            shares = {fp4: spec.rho, high: 1.0 - spec.rho}
        factor = sum(w * self.emulation.get(f, 2.0) for f, w in shares.items())
        train = p.warmup * self.step_s + (p.steps - p.warmup) * self.step_s * factor
        replans = len(range(p.warmup, p.steps, p.interval)) if spec.policy in ("snip", "min_rel_err") else 0
        evals = (p.steps // p.eval_interval + 1) * p.eval_batches * len(p.domains)
        return self.startup_s + train + replans * self.replan_steps * self.step_s \
            + evals * self.eval_step_fraction * self.step_s * factor

    @classmethod
    def from_overheads(cls, path: Path, step_s: float) -> CostModel:
        if not path.is_file():
            raise ValueError(f"--overheads={str(path)!r} does not exist; write it with scripts/bench_overheads.py --out")
        d = json.loads(path.read_text())
        emul = {f: float(v["ratio"]) for f, v in d.get("emulation", {}).get("formats", {}).items() if "ratio" in v}
        kw = {}
        if emul:
            kw["emulation"] = {"bf16": 1.0, **emul}
        if "replan" in d and "replan_over_step" in d["replan"]:
            kw["replan_steps"] = float(d["replan"]["replan_over_step"])
        return cls(step_s, **kw)


def dry_list(specs: Sequence[RunSpec], p: Protocol, cost: CostModel, jobs: int, latest: Mapping[str, dict]) -> str:
    lines = [f"{'run':<44} {'group':<7} {'est_s':>6}  status"]
    todo_s = 0.0
    for s in specs:
        est = cost.run_s(s, p)
        done = is_done(s, p, latest)
        todo_s += 0.0 if done else est
        lines.append(f"{s.name:<44} {s.group:<7} {est:>6.0f}  {'done' if done else 'todo'}")
    total = sum(cost.run_s(s, p) for s in specs)
    lines.append(f"{len(specs)} runs; estimated {total / 60 / max(1, jobs):.0f} min in all, "
                 f"{todo_s / 60 / max(1, jobs):.0f} min still to run, with {jobs} job(s) at a time "
                 f"(BF16 step {cost.step_s:.3f} s per job, emulation factors {dict(cost.emulation)}, "
                 f"re-plan = {cost.replan_steps:.0f} steps; default factors: measured in the default comparison, "
                 f"compiled quantizers; "
                 f"pass --overheads <bench_overheads.py JSON> for others)")
    return "\n".join(lines)


# ======================================================================================
# Aggregation
# ======================================================================================
@dataclass(frozen=True)
class Row:
    """One (policy, formats, rho) group's final loss on one domain, over seeds."""

    policy: str
    formats: tuple[str, ...] | None
    rho: float | None
    domain: str
    n: int
    mean: float
    std: float  # sample std over seeds (ddof=1); nan with one seed
    gap_pct: float  # 100 * (mean - mean_bf16) / mean_bf16
    paired_mean: float  # mean over shared seeds of (loss - loss_bf16 of the same seed)
    paired_std: float  # sample std of those differences; nan with < 2 pairs
    n_pairs: int
    fp4_share: float | None  # mean over seeds of the final plan's FP4 FLOP share


def _std(x: Sequence[float]) -> float:
    return float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")


def by_seed(results: Iterable[dict], policy: str, formats, rho, domain: str) -> dict[int, float]:
    return {r["seed"]: float(r["final"][domain]) for r in results
            if r["policy"] == policy and _fmt_key(r.get("formats")) == _fmt_key(formats) and r.get("rho") == rho
            and domain in r.get("final", {})}


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, float, int]:
    """Mean and sample std of a[s] - b[s] over the seeds both have, and how many."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    return (float(np.mean(d)) if d else float("nan")), _std(d), len(d)


def group_order(groups: Iterable[tuple], format_sets: Sequence[tuple[str, ...]] = ()) -> list[tuple]:
    """(policy, formats, rho) groups in report order: format-free policies first, then per format
    set (in ``format_sets`` order, others after) by rho and the policy order of the module."""
    pol_rank = {pol: i for i, pol in enumerate(FORMAT_FREE_POLICIES + FORMAT_POLICIES)}
    fs_rank = {fs: i for i, fs in enumerate(format_sets)}
    return sorted(dict.fromkeys(groups), key=lambda g: (
        g[1] is not None, fs_rank.get(g[1], len(fs_rank)), g[1] or (), g[2] or 0.0, pol_rank.get(g[0], 99), g[0]))


def aggregate(results: Sequence[dict], domain: str, format_sets: Sequence[tuple[str, ...]] = ()) -> list[Row]:
    """One Row per (policy, formats, rho) present in ``results``, in report order."""
    groups = group_order(((r["policy"], _fmt_key(r.get("formats")), r.get("rho")) for r in results), format_sets)
    ref = by_seed(results, "bf16", None, None, domain)
    ref_mean = float(np.mean(list(ref.values()))) if ref else float("nan")
    rows = []
    for pol, fs, rho in groups:
        vals = by_seed(results, pol, fs, rho, domain)
        if not vals:
            continue
        mean = float(np.mean(list(vals.values())))
        pm, ps, n_pairs = paired(vals, ref)
        shares = [r["fp4_share"] for r in results if r["policy"] == pol and _fmt_key(r.get("formats")) == fs
                  and r.get("rho") == rho and r.get("fp4_share") is not None]
        rows.append(Row(pol, fs, rho, domain, len(vals), mean, _std(list(vals.values())),
                        100.0 * (mean - ref_mean) / ref_mean if ref else float("nan"), pm, ps, n_pairs,
                        float(np.mean(shares)) if shares else None))
    return rows


# ======================================================================================
# Report
# ======================================================================================
DISCUSSION_FILE = "results_discussion.md"  # hand-written, next to the report; included verbatim
PLACEHOLDER = (f"> **PLACEHOLDER - to be written from the numbers above, in {DISCUSSION_FILE} next to this report.** "
               "This generated report states no conclusions.")


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
    v = [r["fp4_share"] for r in results if r["policy"] == policy and _fmt_key(r.get("formats")) == formats
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
                         f"{_pm(s_mean, _std(list(s.values())))} | {base or '—'} | "
                         f"{_num(_share(results, base, fs, rho), '.3f')} | {_pm(b_mean, _std(list(b.values())))} | "
                         f"{_pm(pm, ps, signed=True)} ({n}) |")
    return lines


def _domain_title(domain: str, p: Protocol) -> str:
    if domain == TRAIN_DOMAIN:
        return f"training domain: held-out documents of {p.train_corpus} (`val_loss`)"
    return f"other domain: {domain[len('val_loss_'):]} (`{domain}`)"


def _smooth(steps: list[int], values: np.ndarray, window: int) -> tuple[list[int], np.ndarray]:
    if len(values) <= window:
        return steps, values
    return steps[window - 1:], np.convolve(values, np.ones(window) / window, mode="valid")


def plot_curves(results: Sequence[dict], p: Protocol, formats: tuple[str, ...], out: Path) -> Path | None:
    """Curves at the primary rho for one format set, one column per validation domain plus the
    training loss (50-step moving average). Top row: mean over seeds. Bottom row: the paired
    difference to the BF16 run of the same seed, mean over seeds (where the policies differ;
    the top row's curves mostly overlap). Format-free policies appear in every figure (of the
    uniform FP4 ones only this set's format)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def member(r: dict) -> bool:
        if r.get("formats") is None:
            fmt = r["policy"].split(":", 1)[1] if r["policy"].startswith("uniform:") else None
            return fmt is None or fmt not in FP4_FORMATS or fmt in formats
        return tuple(r["formats"]) == formats and r.get("rho") == p.rho

    chosen = [r for r in results if member(r) and Path(r["run_dir"], "metrics.jsonl").is_file()]
    if not chosen:
        return None
    policies = [g[0] for g in group_order((r["policy"], None, None) for r in chosen)]
    metrics = [*p.domains, "loss"]
    # series[policy][metric][seed] = {step: value}
    series: dict[str, dict[str, dict[int, dict[int, float]]]] = {}
    for r in chosen:
        run = load_run(r["run_dir"])
        for metric in metrics:
            if metric in run.series:
                series.setdefault(r["policy"], {}).setdefault(metric, {})[r["seed"]] = dict(zip(*run.series[metric]))
    fig, axes = plt.subplots(2, len(metrics), figsize=(5.2 * len(metrics), 8.2), squeeze=False, sharex=True)
    colors = plt.get_cmap("tab10").colors
    for col, metric in enumerate(metrics):
        top, bottom = axes[0][col], axes[1][col]
        ref = series.get("bf16", {}).get(metric, {})
        tail: list[float] = []
        for i, pol in enumerate(policies):
            by_seed_steps = series.get(pol, {}).get(metric, {})
            if not by_seed_steps:
                continue
            style = {"color": colors[i % len(colors)], "linewidth": 1.5, "markersize": 3}
            steps = sorted(set.intersection(*(set(v) for v in by_seed_steps.values())))
            mean = np.array([np.mean([v[t] for v in by_seed_steps.values()]) for t in steps])
            xs, ys = _smooth(steps, mean, 50) if metric == "loss" else (steps, mean)
            top.plot(xs, ys, marker="o" if len(xs) <= 30 else None, label=f"{pol} (n={len(by_seed_steps)})", **style)
            tail += [float(v) for t, v in zip(xs, ys) if t >= 0.3 * p.steps and math.isfinite(v)]
            seeds = sorted(set(by_seed_steps) & set(ref))
            if pol != "bf16" and seeds:
                dsteps = sorted(set.intersection(*(set(by_seed_steps[s]) & set(ref[s]) for s in seeds)))
                diff = np.array([np.mean([by_seed_steps[s][t] - ref[s][t] for s in seeds]) for t in dsteps])
                xs, ys = _smooth(dsteps, diff, 50) if metric == "loss" else (dsteps, diff)
                bottom.plot(xs, ys, marker="o" if len(xs) <= 30 else None, **style)
        if tail:
            lo, hi = min(tail), max(tail)
            pad = 0.08 * (hi - lo) or 0.02
            top.set_ylim(lo - pad, hi + pad)
        name = "train loss (50-step mean)" if metric == "loss" else metric
        top.set_title(f"{name}, mean over seeds", fontsize=10)
        bottom.set_title("minus the BF16 run of the same seed, mean over seeds", fontsize=9)
        bottom.axhline(0.0, color="black", linewidth=0.8)
        top.set_ylabel("nats/token")
        bottom.set_ylabel("difference (nats/token)")
        bottom.set_xlabel("optimizer step")
        for ax in (top, bottom):
            ax.axvline(p.warmup, color="grey", linewidth=0.8, linestyle=":")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"formats {','.join(formats)}, rho={p.rho:g} (dotted line: policy applied at step {p.warmup}; "
                 f"top row zoomed past step {int(0.3 * p.steps)})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def overheads_section(path: Path) -> list[str]:
    if not path.is_file():
        return [f"_Not measured yet: run `python scripts/bench_overheads.py` (writes {path.name})._"]
    d = json.loads(path.read_text())
    m = d.get("machine", {})
    load = (m.get("load_avg_at_start") or [None])[0]
    lines = [(f"From `{path.as_posix()}` (`{d.get('command', 'python scripts/bench_overheads.py')}`; "
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


def write_report(results: Sequence[dict], p: Protocol, report: Path, *, command: str,
                 all_records: Sequence[dict] = ()) -> Path:
    """Write the markdown report (+ figures under ``<report dir>/figures/``) from ``results``."""
    docs = report.parent
    fig_dir = docs / "figures"
    primary = [r for r in results if r.get("rho") in (None, p.rho)]
    best = {fs: best_static_baseline(results, fs, p.rho) for fs in p.sweep_format_sets}
    params = next((r["params_m"] for r in results if r.get("params_m")), None)
    cfg = load_config(config_path(p), list(p.overrides))
    t = cfg.training
    tokens = p.steps * t.global_batch_size * t.seq_len
    m = cfg.model
    wall = sum(r.get("wall_s", 0.0) for r in results)
    out = [
        "# Results: precision policies compared",
        "",
        "Generated by `scripts/compare_policies.py`; do not edit by hand. Command:",
        "",
        "```bash",
        command,
        "```",
        "",
        "## Protocol",
        "",
        (f"- Model: `{p.config}`{' with ' + ' '.join(f'`{o}`' for o in p.overrides) if p.overrides else ''}: "
        f"{m.num_layers} layers, d={m.hidden_size}, ffn {m.ffn_hidden_size}, {m.num_attention_heads} heads / "
        f"{m.num_kv_heads} KV, {_num(params, '.2f')}M parameters."),
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
    out += ["", f"## Primary comparison (rho = {p.rho:g})", ""]
    for domain in p.domains:
        rows = aggregate(primary, domain, p.format_sets)
        if rows:
            out += [f"### {_domain_title(domain, p)}", "", *results_table(rows), ""]
    out += ["## Loss curves", ""]
    for fs in p.format_sets:
        png = plot_curves(results, p, fs, fig_dir / f"compare_curves_{'-'.join(fs)}.png")
        if png:
            out += [f"![curves {','.join(fs)}]({png.relative_to(docs).as_posix()})", ""]
    out += ["## rho sweep: SNIP vs the best static baseline", ""]
    if p.sweep_rhos and p.sweep_format_sets:
        out += [f"- Best static baseline by training-domain `val_loss` at rho={p.rho:g}: "
            + ", ".join(f"`{','.join(fs)}` -> {best[fs] or 'not determined (no primary results)'}" for fs in best), ""]
    else:
        out += ["_Not run (--no-sweep)._", ""]
    for domain in p.domains:
        tbl = sweep_table(results, p, domain, best)
        if len(tbl) > 2:
            out += [f"### {_domain_title(domain, p)}", "", *tbl, ""]
    out += ["## Final SNIP precision maps", ""]
    for fs in p.format_sets:
        snip_runs = sorted((r for r in results if r["policy"] == "snip" and _fmt_key(r.get("formats")) == fs
                            and r.get("rho") == p.rho), key=lambda r: r["seed"])
        for r in snip_runs:
            for kind in ("precision_map", "timeline"):
                src = Path(r["run_dir"]) / f"{kind}.png"
                if src.is_file():
                    dst = fig_dir / f"compare_snip_{kind}_{'-'.join(fs)}_seed{r['seed']}.png"
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
                    out += [f"![{kind} snip {','.join(fs)} seed {r['seed']}]({dst.relative_to(docs).as_posix()})", ""]
            if (Path(r["run_dir"]) / "precision_map.png").is_file():
                break  # one seed's map per format set
    out += ["## Cost: re-plan time and emulation", ""]
    timing = [r for r in results if r.get("train_s")]
    if timing:
        out += [("Per run, from its metrics: train s = sum of step times (re-plans and evaluations excluded), "
                "re-plan s = sum of the controller's re-plan times, wall s = the whole subprocess (start-up, "
                "data, evaluations, compilation included)."), "",
                "| policy | formats | rho | runs | train s (mean) | re-plan s (mean) | re-plan / train | wall s (mean) |",
                "|---|---|---|---|---|---|---|---|"]
        for key in group_order(((r["policy"], _fmt_key(r.get("formats")), r.get("rho")) for r in timing), p.format_sets):
            rs = [r for r in timing if (r["policy"], _fmt_key(r.get("formats")), r.get("rho")) == key]
            tr, rp, wl = (float(np.mean([r.get(k, 0.0) for r in rs])) for k in ("train_s", "replan_s", "wall_s"))
            out.append(f"| {key[0]} | {_formats_label(key[1])} | {_num(key[2], 'g')} | {len(rs)} | {tr:.1f} | "
                       f"{rp:.1f} | {100 * rp / tr:.1f}% | {wl:.1f} |")
        out.append("")
    out += overheads_section(docs / "overheads.json") + [""]
    out += ["## Metric validation", ""]
    summary = docs / "validation" / "summary.md"
    if summary.is_file():
        body = summary.read_text().strip().splitlines()
        out += [("#" + line) if line.startswith("#") else line for line in body] + [""]
    else:
        out += ["_Not run yet: `python scripts/validate_metrics.py --out docs/validation` writes the summary._", ""]
    # The conclusions are written by a person from the numbers above, in a file of their own, so
    # that regenerating the tables (a rerun, --report-only) never erases them.
    discussion = docs / DISCUSSION_FILE
    out += ["## What this shows", ""]
    out += [discussion.read_text().strip() if discussion.is_file() else PLACEHOLDER, ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(out))
    return report


# ======================================================================================
# Command line
# ======================================================================================
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _format_sets(text: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(f.strip() for f in part.split(",") if f.strip()) for part in text.split(";") if part.strip())


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
    ap.add_argument("--rho", type=float, default=d.rho, help="FP4 target of the primary comparison")
    ap.add_argument("--format-sets", type=_format_sets, default=d.format_sets,
                    help="candidate sets, ';'-separated (default 'fp8,nvfp4;fp8,mxfp4')")
    ap.add_argument("--sweep-rhos", type=_floats, default=d.sweep_rhos)
    ap.add_argument("--sweep-format-sets", type=_format_sets, default=d.sweep_format_sets,
                    help="format sets of the rho sweep (default the harsher 'fp8,mxfp4')")
    ap.add_argument("--no-sweep", action="store_true", help="primary comparison only")
    ap.add_argument("--policies", type=lambda s: tuple(x for x in s.split(";") if x), default=d.policies,
                    help="';'-separated subset of the policies")
    ap.add_argument("--train-corpus", default=d.train_corpus, help="data.train_path (JSONL, indexed prefix, bundled:<name>)")
    ap.add_argument("--valid-corpus", action="append", default=None, metavar="PATH",
                    help=f"other-domain validation corpus (repeatable; default {PYTHON_DOCS} if it exists), "
                         f"in addition to bundled:moby_dick")
    ap.add_argument("--eval-interval", type=int, default=d.eval_interval)
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches)
    ap.add_argument("--out-dir", default="runs/compare")
    ap.add_argument("--report", default="docs/results.md")
    ap.add_argument("--jobs", type=int, default=2, help="training processes at once")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each training process")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before one run is killed")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint")
    ap.add_argument("--step-time", type=float, default=0.19,
                    help="BF16 step time (s) of one job with --jobs running, for --dry-list's estimate "
                         "(default: measured for the default model, 1 thread, 2 jobs at once)")
    ap.add_argument("--overheads", default=None, metavar="JSON",
                    help="bench_overheads.py output with emulation ratios and re-plan cost for the estimate "
                         "(default: built-in measurements for the default model)")
    ap.add_argument("--dry-list", action="store_true", help="print the planned runs and the estimated time; run nothing")
    ap.add_argument("--report-only", action="store_true", help="write the report from results.jsonl; run nothing")
    return ap


def protocol_from_args(args: argparse.Namespace) -> Protocol:
    valid = args.valid_corpus if args.valid_corpus is not None else ([PYTHON_DOCS] if os.path.isfile(PYTHON_DOCS) else [])
    valid = tuple(dict.fromkeys(("bundled:moby_dick", *valid)))
    return Protocol(config=args.config, steps=args.steps, warmup=args.warmup, interval=args.interval,
                    seeds=args.seeds, rho=args.rho, format_sets=args.format_sets,
                    sweep_rhos=() if args.no_sweep else args.sweep_rhos,
                    sweep_format_sets=() if args.no_sweep else args.sweep_format_sets, policies=args.policies,
                    train_corpus=args.train_corpus, valid_corpora=valid,
                    eval_interval=args.eval_interval, eval_batches=args.eval_batches,
                    overrides=DEFAULT_SETS + tuple(args.overrides))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "scripts/compare_policies.py", *(sys.argv[1:] if argv is None else argv)])
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
        print(dry_list(primary + sweep, p, cost, args.jobs, latest_records(records)))
        if any(b is None for b in best.values()):
            print("(sweep baseline shown as bf16_ends until the primary runs pick the best static baseline)")
        return 0
    if not args.report_only:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "protocol.json").write_text(json.dumps({"command": command, **p.to_json_dict()}, indent=1))
        run_all(primary, p, out_dir, jobs=args.jobs, threads=args.threads, timeout_s=args.timeout,
                keep_checkpoints=args.keep_checkpoints)
        records = read_results(results_path)
        if p.sweep_rhos:
            best = {fs: best_static_baseline(current_results(p, records), fs, p.rho) for fs in p.sweep_format_sets}
            print(f"best static baseline (training-domain val_loss, rho={p.rho:g}): {best}")
            run_all(sweep_runs(p, best), p, out_dir, jobs=args.jobs, threads=args.threads, timeout_s=args.timeout,
                    keep_checkpoints=args.keep_checkpoints)
            records = read_results(results_path)
    report = write_report(current_results(p, records), p, Path(args.report), command=command, all_records=records)
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
