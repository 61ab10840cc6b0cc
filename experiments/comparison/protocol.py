"""The comparison's protocol: what is the same for every run, the run list, and each run's configuration.

A run is identified by its *resolved* configuration (``resolved_config``: the config file plus
the protocol's and the driver's overrides, the run directory left out), which every record in
``results.jsonl`` stores; ``same_config`` decides whether a recorded run still counts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_snip.config import Config, load_config, parse_override
from megatron_snip.data.pipeline import corpus_name
from megatron_snip.precision.formats import FORMATS, FP4_FORMATS
from megatron_snip.snip.policies import parse_policy

REPO = Path(__file__).resolve().parents[2]  # the runs start here, so relative paths mean the same in every run

FORMAT_FREE_POLICIES = ("bf16", "uniform:fp8", "uniform:nvfp4", "uniform:mxfp4")
FORMAT_POLICIES = ("bf16_ends", "tail", "attn_protected", "mlp_only", "layer_type", "min_rel_err", "random", "snip",
                   "truth", "tail+switch", "bf16_ends+switch", "snip+switch")
# Run only when --policies names them: the truth policy's re-plan measures every linear's divergences
# by brute force (megatron_snip/snip/truth.py), hundreds of passes, for ablations.
ORACLE_POLICIES = ("truth",)
# The production recipes (issue #33: NVIDIA's last-blocks rule, attention protected, MLP-only FP4) run
# only when --policies names them, so the default comparison and the recorded reports stay as they were.
# NVIDIA's recipe in time (``<rule>+switch``, megatron_snip/snip/policies.py: the rule, with its GEMMs
# promoted, fprop first, where a run-level budget lowers the share; the rule itself under the plan budget):
# run with --set snip.budget=run (docs/snip.md, "Run-level FP4 budget").
PRODUCTION_RULES = ("tail", "attn_protected", "mlp_only", "tail+switch", "bf16_ends+switch")
# SNIP's plan with NVIDIA's switch (``snip+switch``, the same time freedom from SNIP's plan): an
# ablation of the run budget, run only when --policies names it, with --set snip.budget=run.
ABLATIONS = ("snip+switch",)
DEFAULT_POLICIES = FORMAT_FREE_POLICIES + tuple(p for p in FORMAT_POLICIES
                                                if p not in ORACLE_POLICIES + PRODUCTION_RULES + ABLATIONS)
STATIC_BASELINES = ("bf16_ends", "layer_type", "random")  # candidates for the sweep's "best static baseline"
DEFAULT_FORMAT_SETS = (("fp8", "nvfp4"), ("fp8", "mxfp4"))
TRAIN_DOMAIN = "val_loss"
# Other-domain validation corpora by name (the metric is ``val_loss_<name>``): the bundled
# Moby-Dick, and the Python docs that ``scripts/prepare_corpus.py --out corpus`` fetches by package
# name (``--valid-corpus python_docs=PATH`` points elsewhere, ``python_docs=`` drops it).
DEFAULT_VALID_CORPORA = {"moby_dick": "bundled:moby_dick", "python_docs": "corpus/python_docs.jsonl"}
# The default model and batch (on top of tiny.toml): 8 blocks so that bf16_ends at rho=0.75 is a
# real recipe (first and last block high precision = exactly 75% FP4; with tiny's 4 blocks it
# degenerates to all-FP4), d=128 and 128-token sequences so that 54 runs of 500 steps fit in
# one sitting on a small CPU machine (--dry-list prints the estimate; docs/bench/README.md says what it took).
# snip.reuse_step off (tiny.toml turns it on): with it, each re-plan step of a policy that collects
# statistics would train in BF16, a help the static policies do not get; the records predate it.
DEFAULT_SETS = ("model.num_layers=8", "model.hidden_size=128", "model.ffn_hidden_size=384",
                "training.seq_len=128", "training.micro_batch_size=8", "training.global_batch_size=8",
                "snip.reuse_step=false")
# Keys the driver sets per run; a user --set on them would silently break pairing or resume.
DRIVER_KEYS = frozenset({
    "training.seed", "training.run_dir", "training.max_steps", "training.resume", "training.progress",
    "training.log_interval", "training.eval_interval", "training.eval_batches", "training.eval_windows",
    "precision.initial_plan",
    "snip.enabled", "snip.policy", "snip.fp4_target", "snip.formats", "snip.warmup", "snip.interval", "snip.seed",
    "data.train_path", "data.valid_paths", "training.init_from", "training.init_optimizer",
    "snip.target", "snip.time_budget", "snip.time_costs", "data.shuffle_seed",
})
# The continued-pretraining protocol (``base_steps > 0``) sets these too: the base run holds the LR
# at its peak after the config's warmup (an intermediate checkpoint of a longer schedule, as the
# SNIP paper continues TinyLlama's 50k-step one), and every continuation decays it from there with
# training.warmup_steps=0.
CONTINUE_KEYS = frozenset({"training.lr_schedule"})
BASE_POLICY = "base"  # RunSpec.policy of a continued-pretraining base run (BF16, SNIP off)
# Protocol.continuation_order k gives seed s's continuations data.shuffle_seed = STRIDE * k + s: distinct for
# every seed below the stride and every order.
CONTINUATION_ORDER_STRIDE = 1000


@dataclass(frozen=True)
class Protocol:
    """Everything that is the same for every run of one comparison."""

    config: str = "launch/configs/tiny.toml"
    steps: int = 500
    warmup: int = 50
    interval: int = 100
    seeds: tuple[int, ...] = (1, 2, 3)
    rho: float = 0.75  # the primary rho: the sweep's best static baseline and the figures are chosen at it
    format_sets: tuple[tuple[str, ...], ...] = DEFAULT_FORMAT_SETS
    # Per format set, the rhos every policy runs at; () = (rho,) for every set.
    format_rhos: tuple[tuple[float, ...], ...] = ()
    # > 0: continued pretraining. Per seed one BF16 base run of base_steps steps at constant LR
    # (group "base", kept checkpoint); every other run starts from its weights and AdamW moments
    # (training.init_from / init_optimizer) and trains ``steps`` more. 0: every run from scratch.
    base_steps: int = 0
    # The continuation's LR schedule: "config" = the config's own (tiny.toml: cosine decay over every
    # continued step, the reference of the records on file); "wsd" = warmup-stable-decay: the peak held,
    # then a linear decay over the last training.wsd_decay_fraction of the steps (as modern pretraining
    # runs end), so "before decay" means a point of the run (issue #33 item 4).
    continuation_schedule: str = "config"
    # > 0: every continuation sees another order of the training windows from the same base,
    # data.shuffle_seed = CONTINUATION_ORDER_STRIDE * continuation_order + seed (the base is untouched, and
    # training.seed still picks the init and the held-out text). 0: the seed's own order, as every
    # record before it. Replicas of one comparison on the same bases differ only here.
    continuation_order: int = 0
    sweep_rhos: tuple[float, ...] = (0.5, 0.75, 0.9)
    sweep_format_sets: tuple[tuple[str, ...], ...] = (("fp8", "mxfp4"),)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    train_corpus: str = "bundled:sotu"
    valid_corpora: tuple[str, ...] = ("bundled:moby_dick",)
    eval_interval: int = 100
    eval_batches: int = 8
    # Which windows of each validation set (training.eval_windows): "first" = the first eval_batches x
    # micro-batch windows, the records before #33; "spread" = that many spread over the whole set (or
    # all of it where it is smaller), so a domain's figure does not describe its first pages only.
    eval_windows: str = "first"
    overrides: tuple[str, ...] = DEFAULT_SETS  # applied to every run before the driver's own --set
    # "fp4_share" (rho = FP4 share of the linear FLOPs) or "gemm_time" (every rho of the format sets is
    # a GEMM-time budget: modeled linear-GEMM time <= rho x BF16's, with ``time_costs``, snip.time_costs).
    target: str = "fp4_share"
    time_costs: tuple[str, ...] = ()  # "format=ratio" of the modeled GPU (gemm_time), e.g. ("bf16=1", "fp8=0.5")

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ValueError(f"--steps={self.steps} must be > 0")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup={self.warmup} must be in [0, --steps={self.steps}) so the policy is applied")
        if self.interval <= 0:
            raise ValueError(f"--interval={self.interval} must be > 0")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds={list(self.seeds)} must be distinct integers, e.g. 1,2,3")
        for name, r in [("--rho", self.rho), *(("--sweep-rhos", r) for r in self.sweep_rhos),
                        *(("--format-sets ...@", r) for rs in self.format_rhos for r in rs)]:
            if not 0.0 < r <= 1.0:
                raise ValueError(f"{name}={r} must be in (0, 1] (a share of linear-layer FLOPs in FP4)")
        if not self.format_sets:
            raise ValueError("--format-sets is empty; give at least one candidate set, e.g. 'fp8,mxfp4'")
        if self.format_rhos and len(self.format_rhos) != len(self.format_sets):
            raise ValueError(f"{len(self.format_rhos)} rho lists for {len(self.format_sets)} format sets; give one "
                             f"per set (e.g. 'fp8_block,fp4_block@0.75,0.8;fp8,nvfp4@0.75,0.9') or none")
        if self.rho not in self.rhos_of(self.format_sets[0]):
            raise ValueError(f"--rho={self.rho} must be one of the first format set's rhos "
                             f"{list(self.rhos_of(self.format_sets[0]))}")
        if self.continuation_schedule not in ("config", "wsd"):
            raise ValueError(f"--continuation-schedule={self.continuation_schedule!r} must be 'config' or 'wsd'")
        if self.continuation_schedule != "config" and not self.base_steps:
            raise ValueError("--continuation-schedule=wsd needs --base-steps > 0 (it is the continued runs' schedule); "
                             "from scratch, --set training.lr_schedule=\"wsd\" instead")
        if self.continuation_order < 0 or (self.continuation_order and not self.base_steps):
            raise ValueError(f"--continuation-order={self.continuation_order} must be >= 0, and > 0 only with "
                             f"--base-steps > 0 (it reorders the data of the runs continued from a base)")
        if self.continuation_order and max(self.seeds) >= CONTINUATION_ORDER_STRIDE:
            raise ValueError(f"--continuation-order with --seeds up to {max(self.seeds)}: seeds must be below "
                             f"{CONTINUATION_ORDER_STRIDE} so that each seed's order is its own")
        if self.base_steps < 0:
            raise ValueError(f"--base-steps={self.base_steps} must be >= 0 (0 = every run from scratch)")
        if self.target not in ("fp4_share", "gemm_time"):
            raise ValueError(f"--target={self.target!r} must be 'fp4_share' or 'gemm_time'")
        if self.target == "gemm_time" and not self.time_costs:
            raise ValueError("--target=gemm_time needs the modeled GPU's time costs: give --gpu (e.g. h100) or --time-costs")
        timed = self.target == "gemm_time"
        for fs in self.format_sets + self.sweep_format_sets:
            bad = [f for f in fs if f not in FORMATS]
            if bad or not (timed or any(f in FP4_FORMATS for f in fs)) or len(set(fs)) != len(fs):
                raise ValueError(f"format set {','.join(fs)!r} must list distinct formats from {sorted(FORMATS)} "
                                 f"including an FP4 one, e.g. fp8,mxfp4")
        for p in self.policies:
            parse_policy(p)  # ValueError naming the spec forms
            if not is_format_free(p) and p not in FORMAT_POLICIES:
                raise ValueError(f"--policies entry {p!r} is not part of this comparison; choose from "
                                 f"{list(FORMAT_FREE_POLICIES + FORMAT_POLICIES)} or another uniform:<format>")
        names = [corpus_name(p) for p in self.valid_corpora]
        if len(set(names)) != len(names) or "valid" in names:
            raise ValueError(f"--valid-corpus names {names} must be distinct and not 'valid' (each is logged as "
                             f"val_loss_<file stem>); rename a file")
        if self.eval_interval <= 0 or self.eval_batches <= 0:
            raise ValueError(f"--eval-interval={self.eval_interval} and --eval-batches={self.eval_batches} must be > 0")
        if self.eval_windows not in ("first", "spread"):
            raise ValueError(f"--eval-windows={self.eval_windows!r} must be 'first' or 'spread'")
        for ov in self.overrides:
            section, key, _ = parse_override(ov)
            if f"{section}.{key}" in DRIVER_KEYS:
                raise ValueError(f"--set {ov!r}: {section}.{key} is set by the driver per run; use its own option "
                                 f"(--steps, --warmup, --interval, --seeds, --rho, --train-corpus, ...)")
            if self.base_steps and f"{section}.{key}" in CONTINUE_KEYS:
                raise ValueError(f"--set {ov!r}: with --base-steps the driver sets {section}.{key} (constant LR in "
                                 f"the base run); drop it")

    def rhos_of(self, formats: tuple[str, ...]) -> tuple[float, ...]:
        """The FP4 targets every policy runs at for one candidate format set."""
        if not self.format_rhos:
            return (self.rho,)
        return self.format_rhos[self.format_sets.index(formats)]

    @property
    def continued(self) -> bool:
        return self.base_steps > 0

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
    target: str = field(default="fp4_share", compare=False)  # what ``rho`` is: Protocol.target

    @property
    def key(self) -> tuple:
        return (self.policy, self.formats, self.rho, self.seed)

    @property
    def name(self) -> str:
        """Run directory name, e.g. ``snip_fp8-mxfp4_rho0.75_seed1``, ``uniform-nvfp4_seed2`` or ``base_seed1``."""
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", self.policy)
        if self.formats is None:
            return f"{slug}_seed{self.seed}"
        budget = "time" if self.target == "gemm_time" else "rho"
        return f"{slug}_{'-'.join(self.formats)}_{budget}{self.rho:g}_seed{self.seed}"


def is_format_free(policy: str) -> bool:
    """``bf16`` and every ``uniform:<format>`` (e.g. ``uniform:fp4_block``) run once per seed,
    whatever the candidate format sets."""
    return policy == "bf16" or policy.startswith("uniform:")


def base_run(seed: int) -> RunSpec:
    """The continued-pretraining base run of one seed (``Protocol.base_steps`` > 0)."""
    return RunSpec(seed, BASE_POLICY, group="base")


def primary_runs(p: Protocol) -> list[RunSpec]:
    """The primary comparison: format-free policies once per seed, the others once per format set
    and rho of that set.

    Ordered format set first, then seed-major within it, so an interrupted run leaves the first
    (most important) candidate set done for whole seeds (paired comparisons); format-free
    policies come with the first set.
    """
    runs = []
    for i, fs in enumerate(p.format_sets):
        for seed in p.seeds:
            if i == 0:
                runs += [RunSpec(seed, pol) for pol in p.policies if is_format_free(pol)]
            runs += [RunSpec(seed, pol, fs, rho, target=p.target) for rho in p.rhos_of(fs) for pol in FORMAT_POLICIES
                     if pol in p.policies]
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
                    spec = RunSpec(seed, pol, fs, rho, group="sweep", target=p.target)
                    if spec.key not in primary:
                        runs.append(spec)
    return runs


def run_overrides(spec: RunSpec, p: Protocol, run_dir: Path) -> list[str]:
    """The ``--set`` list of one run: the user's overrides, then the driver's (which win).

    In the continued protocol a run starts from ``run_dir.parent / base_run(seed).name``.
    """
    valid = "[" + ", ".join(json.dumps(v) for v in p.valid_corpora) + "]"
    common = [*p.overrides, f"training.seed={spec.seed}", f"training.run_dir={json.dumps(str(run_dir))}",
              "training.resume=false", "training.progress=false", "training.log_interval=1",
              f"training.eval_interval={p.eval_interval}", f"training.eval_batches={p.eval_batches}",
              f"training.eval_windows={json.dumps(p.eval_windows)}",
              "precision.initial_plan=bf16", f"data.train_path={json.dumps(p.train_corpus)}",
              f"data.valid_paths={valid}"]
    if spec.policy == BASE_POLICY:
        return [*common, f"training.max_steps={p.base_steps}", 'training.lr_schedule="constant"',
                "snip.enabled=false"]
    if p.continued:
        base = run_dir.parent / base_run(spec.seed).name
        common += [f"training.init_from={json.dumps(str(base))}", "training.init_optimizer=true",
                   "training.warmup_steps=0"]
        if p.continuation_schedule == "wsd":
            common.append('training.lr_schedule="wsd"')
        if p.continuation_order:
            common.append(f"data.shuffle_seed={CONTINUATION_ORDER_STRIDE * p.continuation_order + spec.seed}")
    if spec.formats is not None:
        formats, rho = spec.formats, spec.rho
    else:
        # Format-free policies ignore the candidates; the controller still checks them, so give a
        # set that contains the run's own FP4 format (if any) and the primary rho.
        fmt = spec.policy.split(":", 1)[1] if spec.policy.startswith("uniform:") else None
        formats = ("fp8", fmt) if fmt in FP4_FORMATS else p.format_sets[0]
        rho = p.rho
    if p.target == "gemm_time":  # rho is the GEMM-time budget on the modeled GPU
        costs = "[" + ", ".join(json.dumps(c) for c in p.time_costs) + "]"
        common += ['snip.target="gemm_time"', f"snip.time_budget={rho}", f"snip.time_costs={costs}"]
        rho = 0.0
    return [*common, f"training.max_steps={p.steps}", "snip.enabled=true", f"snip.policy={json.dumps(spec.policy)}",
            f"snip.fp4_target={rho}", "snip.formats=[" + ", ".join(json.dumps(f) for f in formats) + "]",
            f"snip.warmup={p.warmup}", f"snip.interval={p.interval}", f"snip.seed={spec.seed}"]


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




def fmt_key(formats) -> tuple[str, ...] | None:
    """A record's ``formats`` (a JSON list or None) as a RunSpec holds it."""
    return None if formats is None else tuple(formats)
