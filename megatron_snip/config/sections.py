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
from dataclasses import dataclass, field, fields
from typing import Any

from megatron_snip.config.snip_section import SnipConfig
from megatron_snip.config.values import (
    check_finite,
    check_positive,
    check_seed,
    field_error,
    parse_time_costs,
    toml_value,
)

RECOMPUTE_MODES = ("none", "selective", "full")  # training.recompute (model/llama.py set_recompute)


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
        check_finite("model", self)
        check_positive("model", self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_kv_heads", "max_position_embeddings", "rope_base", "norm_eps", "init_std")
        if self.rope_scaling not in ("none", "llama3"):
            raise field_error("model.rope_scaling", self.rope_scaling, "choose 'none' or 'llama3'")
        if self.rope_scaling == "llama3":
            check_positive("model", self, "rope_scaling_factor", "rope_low_freq_factor", "rope_original_max_position")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise field_error("model.rope_high_freq_factor", self.rope_high_freq_factor,
                           f"must exceed model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3.1: 4 and 1)")
        if self.vocab_size < 0:
            raise field_error("model.vocab_size", self.vocab_size, "must be >= 0 (0 = from the tokenizer)")
        if self.init_std > 1.0:
            raise field_error("model.init_std", self.init_std, "must be in (0, 1] (Llama uses 0.02)")
        if self.hidden_size % self.num_attention_heads:
            raise field_error("model.hidden_size", self.hidden_size,
                       f"must be divisible by model.num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_kv_heads:
            raise field_error("model.num_attention_heads", self.num_attention_heads,
                       f"must be divisible by model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise field_error("model.hidden_size", self.hidden_size, "head_dim = hidden_size / heads must be even for RoPE")

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
        check_finite("parallel", self)
        check_positive("parallel", self, "tp", "pp", "collective_timeout_s")
        if self.pp_schedule not in ("1f1b", "gpipe"):
            raise field_error("parallel.pp_schedule", self.pp_schedule, "choose '1f1b' or 'gpipe'")
        if self.sequence_parallel and self.tp == 1:
            raise field_error("parallel.sequence_parallel", True, "needs parallel.tp > 1 (or set it to false)")


@dataclass(frozen=True)
class PrecisionConfig:
    """Which formats the linear-layer GEMMs start in and which backend runs them."""

    initial_plan: str = "bf16"  # "bf16", "uniform:<format>", a policy spec, or a path to a plan JSON
    # "emulated" (reference quantizers, runs everywhere), "torch" (real FP8 GEMMs via PyTorch's
    # scaled-mm per GEMM, other formats emulated) or "te" (Transformer Engine)
    backend: str = "emulated"
    compile_quantizers: bool = False  # torch.compile the emulated quantizers (faster, bit-identical)
    # Tensor scales (fp8, nvfp4) under tensor parallelism: "tensor" = every TP shard scales by the
    # whole tensor's amax (all-reduced over TP where an operand is sharded: as the unsharded model);
    # "shard" = each shard by its own amax, as Transformer Engine does (backend "te" needs it when
    # parallel.tp > 1). Both are valid (each partial GEMM is dequantized before the TP sum); the
    # emulated reference and SNIP's measured errors follow the chosen one. No effect at tp = 1.
    tp_amax: str = "tensor"

    def __post_init__(self) -> None:
        if self.backend not in ("emulated", "torch", "te"):
            raise field_error("precision.backend", self.backend, "choose 'emulated', 'torch' or 'te'")
        from megatron_snip.precision.gemm import TP_AMAX_MODES

        if self.tp_amax not in TP_AMAX_MODES:
            raise field_error("precision.tp_amax", self.tp_amax,
                       f"choose one of {list(TP_AMAX_MODES)} ('tensor': whole-tensor amax, 'shard': per TP shard)")
        if not self.initial_plan:
            raise field_error("precision.initial_plan", self.initial_plan, "use 'bf16', 'uniform:<format>' or a plan JSON path")


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
    # torch.compile each block's elementwise regions (norms, RoPE + attention, SwiGLU) and the loss
    # without TP; the linears stay eager, so re-plans recompile nothing: model/compiled_regions.py.
    # Within a derived tolerance of eager, not bitwise (tests/unit/test_compiled_regions.py); off by
    # default (it pays only on long runs on CPU, and has not run on CUDA: README).
    compile: bool = False
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
    init_from_ignore_unused: bool = False  # init_from an HF directory: load even if it has tensors no parameter uses
    save_interval: int = 0  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    # Checkpoint in the background (torchtitan's async_mode, Megatron's --async-save): at a save step
    # the state is copied to host memory (pinned on CUDA) and a writer thread writes and sha256s the
    # shard while training continues; the commit follows once every rank's shard is written (checked
    # at the next log/eval/save step; one process: every step). One save in flight at most; the final
    # and preemption saves are waited for. training/async_checkpoint.py, docs/checkpoints.md.
    async_save: bool = False
    # Write a torch.profiler trace (Chrome trace JSON: Perfetto, chrome://tracing, TensorBoard) of
    # steps start..end (1-based, as the log counts them) to <run_dir>/profile/trace_rank<R>.json,
    # quantizers and GEMMs labelled ("quantize:<format>:<operand>", "gemm:<fprop|dgrad|wgrad>:<format>").
    # [] = off (no profiler, no labels). telemetry/profile.py, docs/performance.md.
    profile_steps: tuple[int, ...] = ()
    eval_interval: int = 50
    eval_batches: int = 4
    # Which windows of each validation set the periodic evaluation reads: "first" (its first
    # eval_batches x micro_batch_size windows, the same every time: cheap, and what the recorded results
    # used) or "spread" (as many windows evenly spaced over the whole set, or all of them when it holds
    # fewer: a figure for the domain, not for its first pages; issue #33 item 7).
    eval_windows: str = "first"
    log_interval: int = 10
    # After a stop signal (SIGTERM/SIGUSR1/SIGINT) the run saves at a step boundary (multi-rank: up
    # to two steps later, see training/preemption.py); if it does not within this many seconds, or
    # a second signal arrives, it ends at once without saving. 0 = no deadline. Keep it below
    # torchrun's --shutdown-timeout and above ~2 step times plus one evaluation batch (a stop aborts
    # the evaluation), a re-plan and a checkpoint write.
    preempt_grace_s: float = 180.0
    max_consecutive_skips: int = 5  # non-finite loss/grad steps in a row before the run stops
    # Post-step guard: stop (before saving) when one update multiplies the global parameter norm
    # by more than this, or makes it non-finite; 0 checks finiteness only. Normal steps change it
    # by well under 1%.
    max_param_norm_growth: float = 2.0
    progress: bool = True  # progress bar on stderr

    def __post_init__(self) -> None:
        check_finite("training", self)
        check_seed("training.seed", self.seed)
        if self.resume not in (True, False, "auto"):
            raise field_error("training.resume", self.resume, "choose true, false or \"auto\" (resume if run_dir has a checkpoint)")
        check_positive("training", self, "max_steps", "micro_batch_size", "global_batch_size", "seq_len", "lr",
                  "eval_interval", "eval_batches", "log_interval", "max_consecutive_skips", "keep_checkpoints")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise field_error("training.min_lr", self.min_lr, f"must be in [0, training.lr={self.lr}]")
        if self.eval_windows not in ("first", "spread"):
            raise field_error("training.eval_windows", self.eval_windows, "choose 'first' or 'spread'")
        if self.lr_schedule not in ("cosine", "wsd", "constant"):
            raise field_error("training.lr_schedule", self.lr_schedule, "choose 'cosine', 'wsd' or 'constant'")
        if self.preempt_grace_s < 0:
            raise field_error("training.preempt_grace_s", self.preempt_grace_s, "must be >= 0 seconds (0 = no deadline)")
        if self.warmup_steps < 0:
            raise field_error("training.warmup_steps", self.warmup_steps, "must be >= 0")
        if not 0.0 < self.wsd_decay_fraction <= 1.0:
            raise field_error("training.wsd_decay_fraction", self.wsd_decay_fraction, "must be in (0, 1]")
        for n in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                raise field_error(f"training.{n}", getattr(self, n), "must be in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.adam_eps <= 0:
            raise field_error("training.weight_decay/grad_clip/adam_eps",
                       (self.weight_decay, self.grad_clip, self.adam_eps), "weight_decay, grad_clip >= 0 and adam_eps > 0")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise field_error("training.dtype", self.dtype, "choose 'auto', 'float32' or 'bfloat16'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise field_error("training.device", self.device, "choose 'auto', 'cpu' or 'cuda'")
        if self.max_param_norm_growth != 0 and self.max_param_norm_growth <= 1:
            raise field_error("training.max_param_norm_growth", self.max_param_norm_growth,
                       "must be > 1 (a factor, e.g. 2.0) or 0 (check finiteness only)")
        if self.recompute not in RECOMPUTE_MODES:
            raise field_error("training.recompute", self.recompute, f"choose one of {', '.join(map(repr, RECOMPUTE_MODES))}")
        if self.recompute_every < 1:
            raise field_error("training.recompute_every", self.recompute_every, "must be >= 1 (1 = every block)")
        if self.grad_bucket_mb <= 0:
            raise field_error("training.grad_bucket_mb", self.grad_bucket_mb, "must be > 0 (MiB per reduction bucket)")
        if self.save_interval < 0:
            raise field_error("training.save_interval", self.save_interval, "must be >= 0 (0 = save at the end only)")
        if not self.run_dir:
            raise field_error("training.run_dir", self.run_dir, "give a directory for checkpoints and metrics")
        if self.profile_steps:
            ps = self.profile_steps
            if (len(ps) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in ps)
                    or not 1 <= ps[0] <= ps[1] <= self.max_steps):
                raise field_error("training.profile_steps", list(ps), f"give [start, end] with 1 <= start <= end <= "
                                  f"training.max_steps={self.max_steps} (steps counted from 1, as the log does), or [] for off")
        if self.init_optimizer and not self.init_from:
            raise field_error("training.init_optimizer", True, "needs training.init_from (a run or checkpoint directory)")
        if self.init_from_ignore_unused and not self.init_from:
            raise field_error("training.init_from_ignore_unused", True,
                              "needs training.init_from (a Hugging Face directory); drop it or set training.init_from")


def megatron_blend_string(text: str) -> tuple[str, ...] | None:
    """Megatron's ``--data-path`` string form ``"0.7 corpus/a 0.3 corpus/b"`` as the list form
    ``("0.7", "corpus/a", "0.3", "corpus/b")``; None for anything else (one path, which may hold
    spaces: the form is taken only when its first word is a number and a path follows)."""
    words = text.split()
    if len(words) < 2:
        return None
    try:
        float(words[0])
    except ValueError:
        return None
    return tuple(words)


@dataclass(frozen=True)
class DataConfig:
    """Corpus and tokenizer."""

    # One corpus - a JSONL file (plain or .gz), an indexed .bin/.idx prefix (or its .bin/.idx file), or
    # bundled:<name> - or a blend: Megatron's list ["0.7", "corpus/a", "0.3", "corpus/b"], its string
    # form "0.7 corpus/a 0.3 corpus/b" (as --data-path takes it) or a table {"corpus/a" = 0.7,
    # "corpus/b" = 0.3} (weights normalized; data/blend.py). Each source's held-out split is logged as
    # val_loss_<name>.
    train_path: str | tuple[str, ...] = "bundled:sotu"
    split: str = "95,5"  # train,valid,test weights: documents of train_path held out for "val_loss"
    valid_paths: tuple[str, ...] = ("bundled:moby_dick",)  # extra held-out corpora, logged as val_loss_<name>
    tokenizer: str = "byte"  # "byte" (no training) or "bpe" (HF byte-level BPE)
    tokenizer_path: str = ""  # bpe: tokenizer.json to load (any HF one), or where to save the one trained on train_path
    eod_token: str = ""  # bpe: end-of-document token appended to each document; "" = the tokenizer's own eos
    bos_token: str = ""  # bpe: token put before each document; "" = the tokenizer's own bos (if any), "none" = no BOS
    bpe_vocab_size: int = 4096
    json_key: str = "text"
    # Seed of the training windows' order (each epoch a permutation rng([shuffle_seed, epoch])), apart
    # from training.seed, which still seeds the model's init and which documents are held out. -1: the
    # order follows training.seed (the default, and every recorded run). Like HF's data_seed: runs from
    # one checkpoint (training.init_from) that differ only here see the same held-out text and other
    # training batches.
    shuffle_seed: int = -1
    cache_dir: str = ""  # where tokenized corpora are cached ("" = ~/.cache/megatron_snip)
    # Check every byte of each .bin against its recorded sha256 (PREFIX.bin.sha256, sha256sum format;
    # written by scripts/preprocess_data.py and the cache) at start-up, one pass per file (~1 GB/s).
    # Off: the .bin is checked for its size and, when PREFIX.idx.fingerprint is there, its first and
    # last MiB - a change in between, or another .bin of the same size beside an index without the
    # fingerprint, is not seen (the log says which applies; data/indexed.py).
    verify_full_hash: bool = False

    def __post_init__(self) -> None:
        if self.tokenizer not in ("byte", "bpe"):
            raise field_error("data.tokenizer", self.tokenizer, "choose 'byte' or 'bpe'")
        parts = self.split.split(",")
        try:
            weights = [float(x) for x in parts]
        except ValueError:
            weights = []
        if not 2 <= len(weights) <= 3 or any(w < 0 for w in weights) or weights[0] <= 0 or sum(weights[1:]) <= 0:
            raise field_error("data.split", self.split, "give train,valid[,test] weights like '98,2' with train > 0 and valid > 0")
        if self.bpe_vocab_size < 300:
            raise field_error("data.bpe_vocab_size", self.bpe_vocab_size, "must be >= 300 (256 bytes + merges)")
        if self.shuffle_seed != -1:
            check_seed("data.shuffle_seed", self.shuffle_seed)
        self.blend()  # raises on a malformed blend

    def blend(self) -> tuple[tuple[float, str], ...]:
        """``train_path`` as ((weight, path), ...) with weights summing to 1; one corpus is ((1.0, path),)."""
        tp = self.train_path
        if isinstance(tp, str):
            tp = megatron_blend_string(tp) or tp
        if not tp:  # [] or {} (a str is never empty here: it is checked below)
            raise field_error("data.train_path", list(tp), 'give a corpus (e.g. "bundled:sotu", a JSONL file or an '
                              'indexed prefix) or a blend of weight, path pairs, e.g. ["0.7", "corpus/a", "0.3", '
                              '"corpus/b"]')
        if isinstance(tp, str) or len(tp) == 1:
            path = tp if isinstance(tp, str) else tp[0]
            if not path:
                raise field_error("data.train_path", tp, "give a JSONL file, an indexed .bin/.idx prefix or bundled:sotu")
            return ((1.0, path),)
        shape = ('a blend lists weight, path pairs (Megatron\'s form), e.g. ["0.7", "corpus/a", "0.3", "corpus/b"], '
                 'or a table {"corpus/a" = 0.7, "corpus/b" = 0.3}')
        if len(tp) % 2:
            raise field_error("data.train_path", list(tp), f"{shape}; got {len(tp)} entries")
        pairs = []
        for i in range(0, len(tp), 2):
            w, path = tp[i], tp[i + 1]
            try:
                weight = float(w)
            except ValueError:
                raise field_error("data.train_path", list(tp), f"{shape}; entry {i} ({w!r}) should be a weight") from None
            if not (math.isfinite(weight) and weight > 0):
                raise field_error("data.train_path", list(tp), f"the weight of {path!r} is {w}; weights must be finite and "
                                                        "> 0 (drop a source rather than giving it weight 0)")
            if not path:
                raise field_error("data.train_path", list(tp), f"entry {i + 1} is an empty path; {shape}")
            pairs.append((weight, path))
        paths = [p for _, p in pairs]
        if len(set(paths)) != len(paths):
            dup = next(p for p in paths if paths.count(p) > 1)
            raise field_error("data.train_path", list(tp), f"{dup!r} is listed twice; give each source once with its total weight")
        total = sum(w for w, _ in pairs)
        return tuple((w / total, p) for w, p in pairs)


@dataclass(frozen=True)
class LoggingConfig:
    """Rank-0 logging; W&B is optional and offline unless a key is configured."""

    wandb_project: str = ""  # "" = no W&B
    wandb_entity: str = ""
    wandb_run_name: str = ""
    wandb_mode: str = "auto"  # "auto" (online iff WANDB_API_KEY is set), "online", "offline", "disabled"
    # TensorBoard event files in <run_dir>/tensorboard: W&B's scalars and the precision maps
    # (needs the tensorboard package: pip install -e ".[tensorboard]"; telemetry/tensorboard_sink.py)
    tensorboard: bool = False
    # Per-device peak TFLOP/s for MFU; 0 = the device's dense BF16 peak from precision/capability.py
    # (no MFU logged where unknown, e.g. on CPU).
    peak_tflops: float = 0.0

    def __post_init__(self) -> None:
        if self.peak_tflops < 0:
            raise field_error("logging.peak_tflops", self.peak_tflops, "must be >= 0 (0 = look the device up)")
        if self.wandb_mode not in ("auto", "online", "offline", "disabled"):
            raise field_error("logging.wandb_mode", self.wandb_mode, "choose 'auto', 'online', 'offline' or 'disabled'")


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
            raise field_error("parallel.tp*parallel.pp", p.tp * p.pp,
                       f"must divide the world size {world_size} (data parallel = world / (tp*pp))")
        dp = self.data_parallel_size(world_size)
        for name, val in (("model.num_attention_heads", m.num_attention_heads), ("model.num_kv_heads", m.num_kv_heads),
                          ("model.ffn_hidden_size", m.ffn_hidden_size)):
            if val % p.tp:
                raise field_error(name, val, f"must be divisible by parallel.tp={p.tp}")
        if m.num_layers % p.pp:
            raise field_error("model.num_layers", m.num_layers, f"must be divisible by parallel.pp={p.pp} (even layer split)")
        if t.seq_len > m.max_position_embeddings:
            raise field_error("training.seq_len", t.seq_len,
                       f"exceeds model.max_position_embeddings={m.max_position_embeddings}; lower it or raise the maximum")
        if p.sequence_parallel and t.seq_len % p.tp:
            raise field_error("training.seq_len", t.seq_len, f"must be divisible by parallel.tp={p.tp} with sequence parallelism")
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise field_error("training.global_batch_size", t.global_batch_size,
                       f"must be a multiple of micro_batch_size*dp = {t.micro_batch_size}*{dp}")
        probe_size = self.probe_micro_batch_size()
        if self.snip.enabled and self.snip.propagation_sequences > probe_size:
            raise field_error("snip.propagation_sequences", self.snip.propagation_sequences,
                       f"exceeds the probe micro-batch ({probe_size} sequences, snip.probe_micro_batch_size or "
                       "training.micro_batch_size); lower it or enlarge the probe")
        costs = parse_time_costs(self.snip.time_costs)
        if self.snip.enabled and costs and self.snip.target != "fp4_share":
            missing = [f for f in self.snip.formats if f not in costs]
            if missing:
                raise field_error("snip.time_costs", list(self.snip.time_costs),
                           f"has no entry for the candidate(s) {missing} of snip.formats; add '<format>=<ratio>'")
        if self.snip.enabled and self.snip.fp4_target > 0 and self.snip.target != "gemm_time":
            from megatron_snip.precision.formats import FP4_FORMATS

            if not any(f in FP4_FORMATS for f in self.snip.formats):
                raise field_error("snip.fp4_target", self.snip.fp4_target,
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
            lines.extend(f"{k} = {toml_value(v)}" for k, v in values.items())
            lines.append("")
        return "\n".join(lines)
