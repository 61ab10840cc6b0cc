"""Configuration: a tree of frozen dataclasses, loaded from TOML with dotted overrides.

    cfg = load_config("launch/configs/tiny.toml", ["training.max_steps=60", "snip.fp4_target=0.8"])
    cfg.validate(world_size=1)

Every field is documented where it is declared. ``__post_init__`` checks one
field at a time; ``Config.validate(world_size)`` checks fields against each
other. Errors are ``ValueError`` naming the field, the value and the fix; an
unknown key is an error, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints


RECOMPUTE_MODES = ("none", "selective", "full")  # training.recompute (model/llama.py set_recompute)


def _err(field_name: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"config {field_name}={value!r}: {fix}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not v > 0:  # also catches NaN, which fails every comparison
            raise _err(f"{section}.{n}", v, "must be > 0")


def _finite(section: str, obj: Any) -> None:
    """Every float field of a section must be a finite number (NaN and inf pass ``<= 0`` style
    checks and then fail hours into a run)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise _err(f"{section}.{f.name}", v, "must be a finite number")


@dataclass(frozen=True)
class ModelConfig:
    """Llama architecture (Megatron layout: fused qkv, proj, fused gate+up fc1, fc2 per block)."""

    num_layers: int = 4  # transformer blocks
    hidden_size: int = 256  # d_model
    ffn_hidden_size: int = 768  # SwiGLU inner size (fc1 produces 2x this: gate and up)
    num_attention_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention; == heads for MHA
    vocab_size: int = 0  # 0 = take it from the tokenizer (padded to a multiple of 64)
    max_position_embeddings: int = 4096  # longest sequence RoPE tables are built for
    rope_base: float = 10000.0
    # "none" (plain RoPE) or "llama3" (Llama 3.1's frequency scaling with the four rope_* fields below)
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192  # the context length the unscaled RoPE was trained at
    norm_eps: float = 1e-5
    init_std: float = 0.02  # normal init of weights; output projections scaled by 1/sqrt(2*num_layers)

    def __post_init__(self) -> None:
        _finite("model", self)
        _positive("model", self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_kv_heads", "max_position_embeddings", "rope_base", "norm_eps", "init_std")
        if self.rope_scaling not in ("none", "llama3"):
            raise _err("model.rope_scaling", self.rope_scaling, "choose 'none' or 'llama3'")
        if self.rope_scaling == "llama3":
            _positive("model", self, "rope_scaling_factor", "rope_low_freq_factor", "rope_original_max_position")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise _err("model.rope_high_freq_factor", self.rope_high_freq_factor,
                           f"must exceed model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3.1: 4 and 1)")
        if self.vocab_size < 0:
            raise _err("model.vocab_size", self.vocab_size, "must be >= 0 (0 = from the tokenizer)")
        if self.init_std > 1.0:
            raise _err("model.init_std", self.init_std, "must be in (0, 1] (Llama uses 0.02)")
        if self.hidden_size % self.num_attention_heads:
            raise _err("model.hidden_size", self.hidden_size,
                       f"must be divisible by model.num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_kv_heads:
            raise _err("model.num_attention_heads", self.num_attention_heads,
                       f"must be divisible by model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise _err("model.hidden_size", self.hidden_size, "head_dim = hidden_size / heads must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel layout; data parallel size = world_size / (tp * pp)."""

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    sequence_parallel: bool = False  # shard norms/dropout regions over TP along the sequence
    pp_schedule: str = "1f1b"  # "1f1b" or "gpipe"
    # Seconds a collective may wait for a peer before it fails; a rank whose heartbeat stops for
    # half of this (stopped, swapped out, dead) ends the job naming it (parallel/watchdog.py).
    # Re-plans, evaluations and checkpoints must each fit in it.
    collective_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _finite("parallel", self)
        _positive("parallel", self, "tp", "pp", "collective_timeout_s")
        if self.pp_schedule not in ("1f1b", "gpipe"):
            raise _err("parallel.pp_schedule", self.pp_schedule, "choose '1f1b' or 'gpipe'")
        if self.sequence_parallel and self.tp == 1:
            raise _err("parallel.sequence_parallel", True, "needs parallel.tp > 1 (or set it to false)")


@dataclass(frozen=True)
class PrecisionConfig:
    """Which formats the linear-layer GEMMs start in and which backend runs them."""

    initial_plan: str = "bf16"  # "bf16", "uniform:<format>", a policy spec, or a path to a plan JSON
    # "emulated" (reference quantizers, runs everywhere), "torch" (real FP8 GEMMs via PyTorch's
    # scaled-mm per GEMM, other formats emulated) or "te" (Transformer Engine)
    backend: str = "emulated"
    compile_quantizers: bool = False  # torch.compile the emulated quantizers (faster, bit-identical)

    def __post_init__(self) -> None:
        if self.backend not in ("emulated", "torch", "te"):
            raise _err("precision.backend", self.backend, "choose 'emulated', 'torch' or 'te'")
        if not self.initial_plan:
            raise _err("precision.initial_plan", self.initial_plan, "use 'bf16', 'uniform:<format>' or a plan JSON path")


SNIP_TARGETS = ("fp4_share", "gemm_time", "both")  # snip.target


def parse_time_costs(entries: tuple[str, ...]) -> dict[str, float]:
    """``snip.time_costs`` (``["bf16=1", "fp8=0.5"]``) as {format: relative GEMM time per FLOP}; {} if empty.
    ValueError naming the field unless each entry is ``<known format>=<positive number>``, bf16 among them."""
    from megatron_snip.precision.formats import FORMATS

    out: dict[str, float] = {}
    for e in entries:
        fmt, sep, val = str(e).partition("=")
        fmt = fmt.strip()
        try:
            t = float(val)
        except ValueError:
            t = math.nan
        if not sep or fmt not in FORMATS or not (0 < t < math.inf) or fmt in out:
            raise _err("snip.time_costs", list(entries), f"entry {e!r} must be '<format>=<positive number>' with a "
                       f"distinct format from {sorted(FORMATS)}, e.g. [\"bf16=1\", \"fp8=0.5\"]")
        out[fmt] = t
    if out and "bf16" not in out:
        raise _err("snip.time_costs", list(entries), "must include 'bf16=<ratio>', the reference of time_budget")
    return out


@dataclass(frozen=True)
class SnipConfig:
    """Adaptive precision: when and how to re-plan (see docs/snip.md)."""

    enabled: bool = False
    policy: str = "snip"  # "snip" or a baseline: uniform:<f>, bf16_ends:<a>,<b>, layer_type, min_rel_err, random
    fp4_target: float = 0.75  # minimum share of linear-layer FLOPs in an FP4 format
    formats: tuple[str, ...] = ("fp8", "nvfp4")  # candidate formats per decision unit
    granularity: str = "layer"  # "layer": one format per linear (3 GEMMs tied); "gemm": per GEMM
    warmup: int = 10  # first re-plan at this step
    interval: int = 20  # then every `interval` steps
    probe_batches: int = 2  # micro-batches the statistics are averaged over
    # Sequences per probe micro-batch; 0 = training.micro_batch_size. Smaller is cheaper and noisier
    # (docs/snip.md, "Probe size": on tiny, 1 sequence re-plans in 1.6 steps but plans worse).
    probe_micro_batch_size: int = 0
    weight_divergence_weight: float = 1.0  # lambda in sum(dL + lambda * dW)
    noise_draws: int = 2  # forward-noise passes per probe batch (curvature, one-sided vs the reference pass)
    propagation_sequences: int = 1  # sequences of the first probe batch for the exact dgrad-propagation pass
    solver_max_time: float = 10.0  # CP-SAT max_deterministic_time
    seed: int = 0
    # Static baselines (bf16_ends without counts, layer_type, random) land within one decision unit
    # above fp4_target, per pipeline stage, instead of wherever their rule puts them (layer_type's
    # rule alone gives 0.667 at 0.5): what a fair comparison at equal FP4 share needs.
    fair_share: bool = False
    # Efficiency target (docs/snip.md, "Targets"): "fp4_share" (at least fp4_target of the linear FLOPs
    # in an FP4 format), "gemm_time" (modeled linear-GEMM time at most time_budget x the same GEMMs in
    # BF16 on the target GPU; fp4_target is then not used) or "both". Every policy takes the same target.
    target: str = "fp4_share"
    time_budget: float = 1.0  # gemm_time: e.g. 0.6 = at most 60% of the BF16 GEMM time
    # Relative GEMM time per FLOP as "format=ratio" entries, e.g. ["bf16=1", "fp8=0.5"]; empty: from the
    # GPU the run runs on and precision.backend (precision/capability.py, GEMM_TIME_RATIO). Set it for
    # a device you measured, or to model a GPU from a CPU run.
    time_costs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _finite("snip", self)
        if self.target not in SNIP_TARGETS:
            raise _err("snip.target", self.target, f"choose one of {list(SNIP_TARGETS)}")
        if not self.time_budget > 0:
            raise _err("snip.time_budget", self.time_budget, "must be > 0 (a fraction of the BF16 GEMM time, e.g. 0.6)")
        parse_time_costs(self.time_costs)  # ValueError naming the field
        if not 0.0 <= self.fp4_target <= 1.0:
            raise _err("snip.fp4_target", self.fp4_target, "must be a fraction in [0, 1] (e.g. 0.75)")
        if self.granularity not in ("layer", "gemm"):
            raise _err("snip.granularity", self.granularity, "choose 'layer' or 'gemm'")
        if self.warmup < 0:
            raise _err("snip.warmup", self.warmup, "must be >= 0")
        if self.probe_micro_batch_size < 0:
            raise _err("snip.probe_micro_batch_size", self.probe_micro_batch_size,
                       "must be >= 0 (sequences per probe micro-batch; 0 = training.micro_batch_size)")
        _positive("snip", self, "interval", "probe_batches", "noise_draws", "propagation_sequences", "solver_max_time")
        if self.weight_divergence_weight < 0:
            raise _err("snip.weight_divergence_weight", self.weight_divergence_weight, "must be >= 0")
        if not self.formats:
            raise _err("snip.formats", self.formats, "list at least one candidate format, e.g. ['fp8', 'nvfp4']")
        from megatron_snip.precision.formats import FORMATS

        for f in self.formats:
            if f not in FORMATS:
                raise _err("snip.formats", list(self.formats), f"{f!r} is not a format; choose from {sorted(FORMATS)}")


@dataclass(frozen=True)
class TrainingConfig:
    """Optimization, schedule, batches, checkpoints."""

    max_steps: int = 200
    micro_batch_size: int = 8  # sequences per micro-batch per data-parallel rank
    global_batch_size: int = 8  # sequences per optimizer step over all ranks (multiple of micro * dp)
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_schedule: str = "cosine"  # "cosine", "wsd" (warmup-stable-decay) or "constant"
    warmup_steps: int = 20
    wsd_decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    distributed_optimizer: bool = False  # ZeRO-1: AdamW moments sharded over DP (parallel/distributed_optimizer.py)
    # Start each bucket's gradient reduction (the DP all-reduce, or the distributed optimizer's
    # reduce-scatter) as soon as the last micro-batch's backward has finished its gradients,
    # overlapping backward; waited for before clipping (parallel/ddp.py; the same bits).
    overlap_grad_reduce: bool = False
    grad_bucket_mb: float = 25.0  # gradient reduction bucket size (all-reduce, or ZeRO-1's reduce-scatter)
    recompute: str = "none"  # activation recompute: "none", "selective" (core attention) or "full" (whole blocks)
    recompute_every: int = 1  # "full": recompute every k-th block of each pipeline stage (1 = all)
    seed: int = 1234
    dtype: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU), "float32" or "bfloat16"
    device: str = "auto"  # "auto", "cpu" or "cuda"
    run_dir: str = "runs/default"
    # Continue from the newest verified checkpoint in run_dir: true (a run must be there or
    # none has checkpointed yet), "auto" (the launchers' default: the same, for requeued and
    # restarted jobs) or false (a fresh run; refused if run_dir already holds one).
    resume: bool | str = False
    # Start a new run (step 0, this run_dir) from the weights of: a run directory (its latest
    # checkpoint), one checkpoint directory (run/checkpoints/step_N), or a Hugging Face Llama
    # directory (config.json + safetensors). "" = random init. Ignored when resuming.
    init_from: str = ""
    init_optimizer: bool = False  # init_from one of our checkpoints: also take its AdamW moments
    save_interval: int = 0  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    eval_interval: int = 50
    eval_batches: int = 4
    log_interval: int = 10
    max_consecutive_skips: int = 5  # non-finite loss/grad steps in a row before the run stops
    # Post-step guard: stop (before saving) when one update multiplies the global parameter norm
    # by more than this, or makes it non-finite; 0 checks finiteness only. Normal steps change it
    # by well under 1%.
    max_param_norm_growth: float = 2.0
    progress: bool = True  # progress bar on stderr

    def __post_init__(self) -> None:
        _finite("training", self)
        if self.resume not in (True, False, "auto"):
            raise _err("training.resume", self.resume, "choose true, false or \"auto\" (resume if run_dir has a checkpoint)")
        _positive("training", self, "max_steps", "micro_batch_size", "global_batch_size", "seq_len", "lr",
                  "eval_interval", "eval_batches", "log_interval", "max_consecutive_skips", "keep_checkpoints")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise _err("training.min_lr", self.min_lr, f"must be in [0, training.lr={self.lr}]")
        if self.lr_schedule not in ("cosine", "wsd", "constant"):
            raise _err("training.lr_schedule", self.lr_schedule, "choose 'cosine', 'wsd' or 'constant'")
        if self.warmup_steps < 0:
            raise _err("training.warmup_steps", self.warmup_steps, "must be >= 0")
        if not 0.0 < self.wsd_decay_fraction <= 1.0:
            raise _err("training.wsd_decay_fraction", self.wsd_decay_fraction, "must be in (0, 1]")
        for n in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                raise _err(f"training.{n}", getattr(self, n), "must be in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.adam_eps <= 0:
            raise _err("training.weight_decay/grad_clip/adam_eps",
                       (self.weight_decay, self.grad_clip, self.adam_eps), "weight_decay, grad_clip >= 0 and adam_eps > 0")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise _err("training.dtype", self.dtype, "choose 'auto', 'float32' or 'bfloat16'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise _err("training.device", self.device, "choose 'auto', 'cpu' or 'cuda'")
        if self.max_param_norm_growth != 0 and self.max_param_norm_growth <= 1:
            raise _err("training.max_param_norm_growth", self.max_param_norm_growth,
                       "must be > 1 (a factor, e.g. 2.0) or 0 (check finiteness only)")
        if self.recompute not in RECOMPUTE_MODES:
            raise _err("training.recompute", self.recompute, f"choose one of {', '.join(map(repr, RECOMPUTE_MODES))}")
        if self.recompute_every < 1:
            raise _err("training.recompute_every", self.recompute_every, "must be >= 1 (1 = every block)")
        if self.grad_bucket_mb <= 0:
            raise _err("training.grad_bucket_mb", self.grad_bucket_mb, "must be > 0 (MiB per reduction bucket)")
        if self.save_interval < 0:
            raise _err("training.save_interval", self.save_interval, "must be >= 0 (0 = save at the end only)")
        if not self.run_dir:
            raise _err("training.run_dir", self.run_dir, "give a directory for checkpoints and metrics")
        if self.init_optimizer and not self.init_from:
            raise _err("training.init_optimizer", True, "needs training.init_from (a run or checkpoint directory)")


@dataclass(frozen=True)
class DataConfig:
    """Corpus and tokenizer."""

    train_path: str = "bundled:sotu"  # JSONL file (plain or .gz), an indexed .bin/.idx prefix, or bundled:<name>
    split: str = "95,5"  # train,valid,test weights: documents of train_path held out for "val_loss"
    valid_paths: tuple[str, ...] = ("bundled:moby_dick",)  # extra held-out corpora, logged as val_loss_<name>
    tokenizer: str = "byte"  # "byte" (no training) or "bpe" (HF byte-level BPE)
    tokenizer_path: str = ""  # bpe: tokenizer.json to load (any HF one), or where to save the one trained on train_path
    eod_token: str = ""  # bpe: end-of-document token appended to each document; "" = the tokenizer's own eos
    bos_token: str = ""  # bpe: token put before each document; "" = the tokenizer's own bos (if any), "none" = no BOS
    bpe_vocab_size: int = 4096
    json_key: str = "text"
    cache_dir: str = ""  # where tokenized corpora are cached ("" = ~/.cache/megatron_snip)

    def __post_init__(self) -> None:
        if self.tokenizer not in ("byte", "bpe"):
            raise _err("data.tokenizer", self.tokenizer, "choose 'byte' or 'bpe'")
        parts = self.split.split(",")
        try:
            weights = [float(x) for x in parts]
        except ValueError:
            weights = []
        if not 2 <= len(weights) <= 3 or any(w < 0 for w in weights) or weights[0] <= 0 or sum(weights[1:]) <= 0:
            raise _err("data.split", self.split, "give train,valid[,test] weights like '98,2' with train > 0 and valid > 0")
        if self.bpe_vocab_size < 300:
            raise _err("data.bpe_vocab_size", self.bpe_vocab_size, "must be >= 300 (256 bytes + merges)")
        if not self.train_path:
            raise _err("data.train_path", self.train_path, "give a JSONL file, an indexed .bin/.idx prefix or bundled:sotu")


@dataclass(frozen=True)
class LoggingConfig:
    """Rank-0 logging; W&B is optional and offline unless a key is configured."""

    wandb_project: str = ""  # "" = no W&B
    wandb_entity: str = ""
    wandb_run_name: str = ""
    wandb_mode: str = "auto"  # "auto" (online iff WANDB_API_KEY is set), "online", "offline", "disabled"
    # Per-device peak TFLOP/s for MFU; 0 = the device's dense BF16 peak from precision/capability.py
    # (no MFU logged where unknown, e.g. on CPU).
    peak_tflops: float = 0.0

    def __post_init__(self) -> None:
        if self.peak_tflops < 0:
            raise _err("logging.peak_tflops", self.peak_tflops, "must be >= 0 (0 = look the device up)")
        if self.wandb_mode not in ("auto", "online", "offline", "disabled"):
            raise _err("logging.wandb_mode", self.wandb_mode, "choose 'auto', 'online', 'offline' or 'disabled'")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    snip: SnipConfig = field(default_factory=SnipConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.parallel.tp * self.parallel.pp)

    def probe_micro_batch_size(self) -> int:
        """Sequences per SNIP probe micro-batch: ``snip.probe_micro_batch_size``, 0 meaning the training one."""
        return self.snip.probe_micro_batch_size or self.training.micro_batch_size

    def validate(self, world_size: int = 1) -> Config:
        """Cross-field checks for a run on ``world_size`` ranks; returns self."""
        m, p, t = self.model, self.parallel, self.training
        if world_size % (p.tp * p.pp):
            raise _err("parallel.tp*parallel.pp", p.tp * p.pp,
                       f"must divide the world size {world_size} (data parallel = world / (tp*pp))")
        dp = self.data_parallel_size(world_size)
        for name, val in (("model.num_attention_heads", m.num_attention_heads), ("model.num_kv_heads", m.num_kv_heads),
                          ("model.ffn_hidden_size", m.ffn_hidden_size)):
            if val % p.tp:
                raise _err(name, val, f"must be divisible by parallel.tp={p.tp}")
        if m.num_layers % p.pp:
            raise _err("model.num_layers", m.num_layers, f"must be divisible by parallel.pp={p.pp} (even layer split)")
        if t.seq_len > m.max_position_embeddings:
            raise _err("training.seq_len", t.seq_len,
                       f"exceeds model.max_position_embeddings={m.max_position_embeddings}; lower it or raise the maximum")
        if p.sequence_parallel and t.seq_len % p.tp:
            raise _err("training.seq_len", t.seq_len, f"must be divisible by parallel.tp={p.tp} with sequence parallelism")
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise _err("training.global_batch_size", t.global_batch_size,
                       f"must be a multiple of micro_batch_size*dp = {t.micro_batch_size}*{dp}")
        probe_size = self.probe_micro_batch_size()
        if self.snip.enabled and self.snip.propagation_sequences > probe_size:
            raise _err("snip.propagation_sequences", self.snip.propagation_sequences,
                       f"exceeds the probe micro-batch ({probe_size} sequences, snip.probe_micro_batch_size or "
                       "training.micro_batch_size); lower it or enlarge the probe")
        costs = parse_time_costs(self.snip.time_costs)
        if self.snip.enabled and costs and self.snip.target != "fp4_share":
            missing = [f for f in self.snip.formats if f not in costs]
            if missing:
                raise _err("snip.time_costs", list(self.snip.time_costs),
                           f"has no entry for the candidate(s) {missing} of snip.formats; add '<format>=<ratio>'")
        if self.snip.enabled and self.snip.fp4_target > 0 and self.snip.target != "gemm_time":
            from megatron_snip.precision.formats import FP4_FORMATS

            if not any(f in FP4_FORMATS for f in self.snip.formats):
                raise _err("snip.fp4_target", self.snip.fp4_target,
                           f"cannot be met: snip.formats={list(self.snip.formats)} has no FP4 format; add 'nvfp4' or 'mxfp4' or set fp4_target=0")
        return self

    # --- (de)serialization ----------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(getattr(self, f.name)).items()}
                for f in fields(self)}

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
            lines.append("")
        return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML/override value to the field's type, or raise naming the field."""
    name = f"{section}.{key}"
    origin = get_origin(typ)
    if origin in (Union, types.UnionType):  # bool | str: true/false as booleans, anything else a string
        if isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false")):
            return _coerce(section, key, value, bool)
        return _coerce(section, key, value, str)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise _err(name, value, "must be a list, e.g. [\"fp8\", \"nvfp4\"]")
        (elem,) = {a for a in get_args(typ) if a is not Ellipsis}
        return tuple(_coerce(section, key, v, elem) for v in value)
    if typ is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise _err(name, value, "must be true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _err(name, value, "must be an integer")
        try:
            return int(value)
        except ValueError:
            raise _err(name, value, "must be an integer") from None
    if typ is float:
        if isinstance(value, bool):
            raise _err(name, value, "must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise _err(name, value, "must be a number") from None
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise _err(name, value, "must be a string")
        return str(value)
    return value


_SECTIONS = {f.name: f for f in fields(Config)}


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts (as TOML gives); unknown sections/keys raise ValueError."""
    sections: dict[str, Any] = {}
    hints = get_type_hints(Config)
    for section, values in raw.items():
        if section not in _SECTIONS:
            raise _err(section, "...", f"unknown config section; sections are {sorted(_SECTIONS)}")
        if not isinstance(values, dict):
            raise _err(section, values, "must be a table of key = value")
        cls = hints[section]
        assert is_dataclass(cls)
        field_types = get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in field_types:
                raise _err(f"{section}.{key}", value, f"unknown key; {section} has {sorted(field_types)}")
            kwargs[key] = _coerce(section, key, value, field_types[key])
        sections[section] = cls(**kwargs)
    return Config(**sections)


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.field=value' -> (section, field, value); the value is parsed as TOML if it can be."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"override {text!r} is not 'section.field=value' (e.g. training.max_steps=60)")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings: --set precision.initial_plan=uniform:nvfp4
    return section, key, value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML config (or the defaults when path is None) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; see launch/configs/ for examples")
        try:
            raw = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                             f"give a TOML file such as launch/configs/tiny.toml") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    for ov in overrides:
        section, key, value = parse_override(ov)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise _err(section, raw[section], "must be a table")
        raw[section][key] = value
    return config_from_dict(raw)
