"""Dry-run sizing: what a config costs on ``world_size`` GPUs, computed from shapes alone.

    python -m megatron_snip.train --config launch/configs/llama_70b.toml --dry-run --world-size 64

``estimate(cfg, world_size)`` returns a ``Sizing`` (numbers, for tests and scripts);
``dry_run_report(cfg, world_size)`` renders it as text. Nothing here builds a model,
touches a device or starts a process group. All figures are per optimizer step.

Accounting (stated so the numbers can be checked by hand):

* **Parameters** (``model/shapes.parameter_counts``). Per block: qkv (h+2g)*hd*d, proj d*h*hd, fc1 2f*d, fc2 d*f and two
  RMSNorm weights d. Embedding V*d on the first stage, final norm d and an untied LM head
  V*d on the last stage. Under TP the four linears and the (vocab-parallel) embedding and
  LM head are split over ``tp`` ranks; norm weights are replicated.
* **Weights, gradients, optimizer** (per rank). The fp32 parameters are the master weights
  (autocast casts to BF16 per GEMM): 4 B/param; fp32 gradients 4 B/param; AdamW m and v in
  fp32 8 B/param, divided by dp with ``training.distributed_optimizer`` (ZeRO-1,
  parallel/distributed_optimizer.py: the moments of a 1/dp shard per rank). Bucket-sized
  temporaries of the gradient reduction are not counted.
* **Activations** saved for backward, per block, per token, as the code saves them
  (``activation_bytes``; its docstring has the formula, tests/unit/test_activation_memory.py
  measures it with ``saved_tensors_hooks``): everything in the activation dtype (BF16 under
  autocast, fp32 without) - the residual stream, norm inputs and outputs, every linear's saved
  input whatever its plan; under SP only the sequence shard (emulated and torch backends); flash-style
  attention (no s x s matrix). Under autocast each reference-path (all-BF16) linear and the LM head
  also hold a BF16 copy of their weight, once per step whatever the micro-batches in flight.
  Recompute: "selective" drops RoPE'd q, k, the copy of v and the logsumexp; "full" keeps only each
  recomputed block's input. The last stage adds the LM head: the final norm's input E*d (sharded
  under SP), its output E*d (the LM head's input, gathered under SP), the fp32 softmax 4*V/tp and
  the int64 targets 8,
  plus its weight copy under autocast. A pipeline stage holds the activations of every
  micro-batch in flight: 1F1B keeps min(pp - stage, m) on stage ``stage`` (the first stage
  holds the most: min(pp, m)), GPipe keeps all m, no pipeline keeps one. SNIP's probe passes
  run without recompute (on ``snip.probe_micro_batch_size`` sequences) and are not counted.
* **FLOPs** on the global batch, T tokens (``model/shapes.py``). A linear with weight (N, K) costs 2*T*K*N in
  each of fprop, dgrad and wgrad; the LM head likewise with (V, d); attention scores and
  context cost 4*T*s*h*hd forward and twice that backward per block (the non-causal
  convention of Megatron/PaLM MFU; causal kernels skip about half). Together:
  6*T*(N_params - embedding - norms) + 12*T*s*h*hd*L.
* **SNIP ILP** (``snip/ilp.py``): one Boolean per decision unit and allowed candidate, one
  exactly-one constraint per unit, one global FP4-share floor, one floor per pipeline stage
  when pp > 1. A candidate is allowed on a unit when every GEMM's TP-local operands fit the
  format's blocks (``precision/gemm_shapes.py``, the rule ``apply_plan`` enforces): the
  reduction dimension (K for fprop, N for dgrad, micro_batch*seq_len for wgrad) a multiple
  of the format's block and the local weight a multiple of its 2-D weight block.
* **GPU support.** Set ``MEGATRON_SNIP_GPU`` or pass ``gpu`` (a type of
  ``precision/capability.GPUS``; default h100); each format the run may use is checked
  against that type with ``capability.check_gpu_type``, the rules the start-up check applies.
"""

from __future__ import annotations

import os

from megatron_snip.config import Config
from megatron_snip.model.shapes import (
    attention_flops,
    gemm_flops,
    linear_numel,
    lm_head_gemm_flops,
    model_linear_shapes,
    parameter_counts,
)
from megatron_snip.precision.capability import GPUS, QUANT_LINEAR_BACKENDS, GpuSpec, check_gpu_type
from megatron_snip.precision.formats import FORMATS, FP4_FORMATS
from megatron_snip.precision.plan import GEMMS, LINEARS, PrecisionPlan
from megatron_snip.sizing.checkpoint_time import checkpoint_lines
from megatron_snip.sizing.gemm_time import gemm_time_lines
from megatron_snip.sizing.result import (
    ADAM_BYTES,
    GRAD_BYTES,
    WEIGHT_BYTES,
    ActivationBytes,
    Sizing,
    SnipSizing,
    StageSizing,
)
from megatron_snip.snip.budget import schedule_lines
from megatron_snip.snip.feasibility import max_fp4_share, unrunnable_gemms

GIB = 1024**3
GPU_ENV = "MEGATRON_SNIP_GPU"
DEFAULT_GPU = "h100"


def resolve_gpu(name: str | None = None) -> GpuSpec:
    """The GPU type to size for: ``name``, else ``$MEGATRON_SNIP_GPU``, else H100."""
    key = (name or os.environ.get(GPU_ENV) or DEFAULT_GPU).strip().lower()
    if key not in GPUS:
        raise ValueError(f"GPU type {key!r} (argument gpu or ${GPU_ENV}) is unknown; choose one of {sorted(GPUS)}")
    return GPUS[key]


# --------------------------------------------------------------------------------------
# Estimation
# --------------------------------------------------------------------------------------
def _vocab(cfg: Config) -> tuple[int, str]:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    if cfg.data.tokenizer == "byte":
        return 320, "byte tokenizer (256 bytes + EOD, padded to 64)"
    padded = -(-cfg.data.bpe_vocab_size // 64) * 64
    return padded, f"at most data.bpe_vocab_size={cfg.data.bpe_vocab_size} padded to 64"


def _support(backend: str, fmt: str, gpu: GpuSpec) -> tuple[bool, str]:
    cap = check_gpu_type(backend, fmt, gpu)
    return cap.ok, cap.reason


def _check_te_settings(cfg: Config, formats: tuple[str, ...]) -> None:
    """The te backend's start-up refusals that follow from the config alone (``TEBackend.check_run``
    also checks the initial plan): the dry run accepts only what the run would start with. GPU runs
    compute in bf16 unless ``training.dtype="float32"``."""
    if cfg.precision.backend != "te":
        return
    import torch

    from megatron_snip.precision.backends.te import refusal, setting_problems

    problems = setting_problems(
        formats, tp_size=cfg.parallel.tp, tp_amax=cfg.precision.tp_amax,
        per_gemm_replans=cfg.snip.enabled and cfg.snip.granularity == "gemm",
        activation_dtype=torch.float32 if cfg.training.dtype == "float32" else torch.bfloat16)
    if problems:
        raise refusal(problems)


def _formats_used(cfg: Config) -> tuple[str, ...]:
    """Formats the run may ask the backend for: the initial plan's and SNIP's candidates."""
    spec = cfg.precision.initial_plan
    used: set[str] = {"bf16"}
    if spec.startswith("uniform:"):
        used.add(spec.split(":", 1)[1])
    elif spec.endswith(".json"):
        used.update(PrecisionPlan.load(spec).format_counts())  # ValueError if missing or malformed
    elif spec != "bf16":
        used.update(cfg.snip.formats)  # a baseline policy draws on the candidates
    if cfg.snip.enabled:
        used.update(cfg.snip.formats)
    return tuple(f for f in FORMATS if f in used)


def _snip_sizing(cfg: Config, tp: int, pp: int) -> SnipSizing:
    s, m = cfg.snip, cfg.model
    unrunnable = unrunnable_gemms(cfg, tp)  # the divisibility rules, as the start-up check applies them

    def ok(fmt: str, lin: str, gemm: str) -> bool:
        return (lin, gemm) not in unrunnable.get(fmt, {})

    # A unit is one GEMM ("gemm") or a linear's three tied GEMMs ("layer"); every block is alike.
    unit_gemms = [(lin, gs) for lin in LINEARS
                  for gs in ([GEMMS] if s.granularity == "layer" else [(gm,) for gm in GEMMS])]
    allowed = {f: m.num_layers * sum(all(ok(f, lin, gm) for gm in gs) for lin, gs in unit_gemms) for f in s.formats}
    units = m.num_layers * len(unit_gemms)
    numel = linear_numel(model_linear_shapes(m))
    per_level = 1 + (pp if pp > 1 else 0)  # global + one per stage
    floors = per_level if s.fp4_target > 0 and s.target != "gemm_time" else 0
    kinds = tuple((numel[lin] * len(gs), tuple(f for f in s.formats if all(ok(f, lin, gm) for gm in gs)))
                  for lin, gs in unit_gemms)
    return SnipSizing(
        enabled=s.enabled, granularity=s.granularity, formats=tuple(s.formats), units=units, allowed=allowed,
        booleans=sum(allowed.values()), exactly_one=units, fp4_floors=floors, max_fp4_share=max_fp4_share(cfg, unrunnable),
        time_caps=per_level if s.target != "fp4_share" else 0, unit_kinds=kinds,
        unit_names=tuple((lin, tuple(gs)) for lin, gs in unit_gemms),
    )


def _quantized_linears(cfg: Config) -> set[str]:
    """Linears whose GEMMs the initial plan puts on the quantized path (any GEMM not BF16, any layer);
    a baseline policy spec counts as all of them (it is resolved only at start-up)."""
    spec = cfg.precision.initial_plan
    if spec == "bf16":
        return set()
    if spec.startswith("uniform:"):
        return set() if spec.split(":", 1)[1] == "bf16" else set(LINEARS)
    if spec.endswith(".json"):
        return {gid.linear for gid, fmt in PrecisionPlan.load(spec).entries if fmt != "bf16"}
    return set(LINEARS)


def activation_bytes(cfg: Config) -> ActivationBytes:
    """Saved-for-backward bytes of one block on one rank, following the code (model/llama.py,
    model/norm.py, model/recompute.py, precision/gemm.py). ``E`` = 2 under BF16 autocast, 4 in
    fp32: the activation dtype, which the residual stream, the norms' outputs and every linear's
    output and saved input are in (linears on the reference path save their input as ``F.linear``
    does; on the quantized path ``_QuantLinearFn`` saves x as given, which is that same tensor).
    Per token:

    * norms (x2): the norm's input (the residual stream) E*d - 1/rms and the fp32 normalized
      rows are recomputed in backward - and the next linear's input (the norm output) E*d;
    * attention: RoPE'd q, k and a compact copy of v (E*(h+2g)*hd), the fp32 logsumexp 4h and
      the output E*h*hd, which is also proj's input; flash-style attention, no s x s matrix (the
      CPU kernel used here, SDPA's flash kernel for CPU, does not save one either);
    * SwiGLU: fc1's output E*2f (gate and up; silu(gate) * up is recomputed) and fc2's input E*f;
    * selective recompute keeps, of the attention, only the qkv output (E*(h+2g)*hd) and the output;
      full recompute keeps only the block's input E*d.

    Tensor parallelism divides the head and ffn terms by tp; sequence parallelism divides the norm
    terms and, on the emulated and torch backends, the column-parallel linears' inputs too (each rank saves
    its sequence shard and re-gathers it in backward: parallel/sequence_shard.py; TE: gathered).
    Under autocast each reference-path linear also saves a BF16 copy of its weight (once per step).
    """
    m, t, p = cfg.model, cfg.training, cfg.parallel
    tp, sp = p.tp, p.sequence_parallel
    d, f, hd, h, g = m.hidden_size, m.ffn_hidden_size, m.head_dim, m.num_attention_heads, m.num_kv_heads
    e = 4 if t.dtype == "float32" else 2
    seq_shard = tp if sp else 1
    # Column-parallel inputs under SP: the emulated and torch backends save the local shard
    # (parallel/sequence_shard.py), Transformer Engine's modules the gathered input.
    input_shard = seq_shard if cfg.precision.backend in QUANT_LINEAR_BACKENDS else 1
    norms = 2 * e * d // seq_shard + 2 * e * d // input_shard
    qkv_width = (h + 2 * g) * hd
    core = e * qkv_width if t.recompute == "selective" else e * qkv_width + 4 * h
    attention = (core + e * h * hd) // tp
    mlp = 3 * e * f // tp
    quant = _quantized_linears(cfg)
    shapes = model_linear_shapes(cfg.model)
    copies = 0 if e == 4 else sum(2 * n * k // tp for lin, (n, k) in shapes.items() if lin not in quant)
    return ActivationBytes(stored=norms + attention + mlp, recomputed=e * d // seq_shard,
                           weight_copies_per_block=copies, mode=t.recompute, every=t.recompute_every)


def estimate(cfg: Config, world_size: int, gpu: str | None = None) -> Sizing:
    """Size ``cfg`` on ``world_size`` ranks (validates the config for that world size first).

    Args:
        cfg: the run's config.
        world_size: total ranks (= GPUs); must be a multiple of tp * pp.
        gpu: GPU type name (see ``GPUS``); default ``$MEGATRON_SNIP_GPU`` or H100.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer (e.g. --world-size 64)")
    cfg.validate(world_size)
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp = p.tp, p.pp
    dp = cfg.data_parallel_size(world_size)
    d, L = m.hidden_size, m.num_layers
    vocab, vocab_source = _vocab(cfg)
    vocab_local = -(-vocab // tp)
    per_stage = L // pp

    counts = parameter_counts(m, vocab)
    block_params_local = counts.block_linears // tp + counts.block_norms  # norms replicated over TP
    params_embedding, params_head = counts.embedding, counts.lm_head + counts.final_norm
    params_blocks = counts.blocks

    # Activations per token per block on one rank (module docstring, activation_bytes).
    e = 4 if t.dtype == "float32" else 2
    acts = activation_bytes(cfg)
    head_act = e * d // (tp if p.sequence_parallel else 1) + e * d + 4 * vocab_local + 8
    head_copies = 2 * vocab_local * d if e == 2 else 0  # autocast's BF16 copy of the LM head weight
    tokens_micro = t.micro_batch_size * t.seq_len
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    tokens = t.global_batch_size * t.seq_len

    # FLOPs on the global batch.
    flops: dict[str, int] = {}
    for lin, one_gemm in gemm_flops(model_linear_shapes(m), tokens).items():
        for gemm in GEMMS:
            flops[f"{lin}.{gemm}"] = one_gemm * L
    attn_fwd = attention_flops(m, tokens, t.seq_len) * L
    flops["attention.fwd"], flops["attention.bwd"] = attn_fwd, 2 * attn_fwd
    for gemm in GEMMS:
        flops[f"lm_head.{gemm}"] = lm_head_gemm_flops(m, vocab, tokens)
    block_flops = (sum(v for k, v in flops.items() if not k.startswith("lm_head"))) // L
    head_flops = len(GEMMS) * lm_head_gemm_flops(m, vocab, tokens)

    stages = []
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        params = (per_stage * block_params_local + (vocab_local * d if first else 0)  # embedding shard
                  + (vocab_local * d + d if last else 0))  # LM head shard + final norm
        if pp == 1:
            in_flight = 1
        elif p.pp_schedule == "gpipe":
            in_flight = micro_batches
        else:
            in_flight = min(pp - s, micro_batches)
        # Weight copies once per stage (the step's, shared by the micro-batches in flight).
        act = (in_flight * (acts.stage_bytes(per_stage, tokens_micro) + (head_act * tokens_micro if last else 0))
               + acts.copy_bytes(per_stage) + (head_copies if last else 0))
        stage_flops = (per_stage * block_flops + (head_flops if last else 0)) // (tp * dp)
        stages.append(StageSizing(s, s * per_stage, (s + 1) * per_stage - 1, params, in_flight, act, stage_flops,
                                  optimizer_shards=dp if t.distributed_optimizer else 1))

    gpu_spec = resolve_gpu(gpu)
    used = _formats_used(cfg)
    _check_te_settings(cfg, used)
    return Sizing(
        world_size=world_size, tp=tp, pp=pp, dp=dp, sequence_parallel=p.sequence_parallel, schedule=p.pp_schedule,
        vocab_size=vocab, vocab_source=vocab_source, layers_per_stage=per_stage,
        params_total=params_embedding + params_blocks + params_head, params_embedding=params_embedding,
        params_blocks=params_blocks, params_head=params_head,
        micro_batch=t.micro_batch_size, seq_len=t.seq_len, global_batch=t.global_batch_size,
        micro_batches=micro_batches, tokens_per_step=tokens,
        activation_element_bytes=e, activation_bytes_per_token_layer=acts.stored, activations=acts,
        stages=tuple(stages), flops=flops, snip=_snip_sizing(cfg, tp, pp), gpu=gpu_spec,
        backend=cfg.precision.backend, formats_used=used,
        support={fmt: _support(cfg.precision.backend, fmt, gpu_spec) for fmt in used},
    )


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def _flops(n: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:8.2f} {unit}"
    return f"{n:8.0f} FLOP"


def dry_run_report(cfg: Config, world_size: int, gpu: str | None = None) -> str:
    """The ``--dry-run`` text: layout, per-rank memory, FLOPs, SNIP problem size, GPU support."""
    s = estimate(cfg, world_size, gpu)
    m, sn = cfg.model, s.snip
    out: list[str] = []
    add = out.append
    add(f"model       {m.num_layers} blocks, d={m.hidden_size}, ffn={m.ffn_hidden_size}, heads {m.num_attention_heads} "
        f"(kv {m.num_kv_heads}, head_dim {m.head_dim}), vocab {s.vocab_size} ({s.vocab_source})")
    add(f"parameters  {s.params_total:,} = embedding {s.params_embedding:,} + blocks {s.params_blocks:,} "
        f"+ final norm & LM head {s.params_head:,}")
    add(f"layout      world {s.world_size} = TP {s.tp} x PP {s.pp} x DP {s.dp}; sequence parallel "
        f"{'on' if s.sequence_parallel else 'off'}; schedule {s.schedule if s.pp > 1 else 'none (pp=1)'}")
    shown = s.stages if s.pp <= 4 else (*s.stages[:2], None, s.stages[-1])
    add(f"            {s.layers_per_stage} blocks per stage: "
        + ", ".join("..." if st is None else f"stage {st.stage} {st.first_layer}-{st.last_layer}" for st in shown)
        + " (embedding on the first stage, final norm + LM head on the last)")
    add(f"batch       micro {s.micro_batch} x seq {s.seq_len}; global {s.global_batch} sequences = "
        f"{s.tokens_per_step:,} tokens/step; {s.micro_batches} micro-batches per DP rank"
        + (f"; pipeline bubble (pp-1)/(m+pp-1) = {s.pipeline_bubble:.2%}" if s.pp > 1 else ""))
    add("")
    cols = [s.stages[0]] if s.pp == 1 else [s.stages[0], s.stages[-1]]
    head = "".join(f"{'stage ' + str(c.stage):>12}" for c in cols)
    add(f"{'memory per rank (GiB)':<29}{head}")
    rows = [("parameters (millions)", [f"{c.params / 1e6:12.1f}" for c in cols]),
            (f"weights fp32 ({WEIGHT_BYTES} B/param)", [f"{_gib(c.weight_bytes):>12}" for c in cols]),
            (f"gradients fp32 ({GRAD_BYTES} B/param)", [f"{_gib(c.grad_bytes):>12}" for c in cols]),
            (f"Adam m+v fp32 ({ADAM_BYTES} B/param"
             + (f" / dp {cols[0].optimizer_shards})" if cols[0].optimizer_shards > 1 else ")"),
             [f"{_gib(c.optimizer_bytes):>12}" for c in cols]),
            ("micro-batches in flight", [f"{c.in_flight:12d}" for c in cols]),
            ("activations", [f"{_gib(c.activation_bytes):>12}" for c in cols]),
            ("total", [f"{_gib(c.total_bytes):>12}" for c in cols])]
    for name, vals in rows:
        add(f"  {name:<27}" + "".join(vals))
    a = s.activations
    recompute = {"none": "no recompute", "selective": "selective recompute (core attention)",
                 "full": f"full recompute of {a.recomputed_blocks(s.layers_per_stage)} of {s.layers_per_stage} "
                         f"blocks per stage ({a.recomputed:,} B per token each)"}[a.mode]
    add(f"  activations: {s.activation_bytes_per_token_layer:,} B per token per stored block per rank "
        f"+ {a.weight_copies_per_block / 2**20:,.1f} MiB of BF16 weight copies per block (once per step) "
        f"(as the code saves them: {'BF16 autocast' if s.activation_element_bytes == 2 else 'fp32'} residual, "
        f"norms and linear inputs, {'with' if s.sequence_parallel else 'without'} sequence parallelism, "
        f"{recompute}; see sizing/dry_run.py)")
    peak = s.peak_stage
    room = s.gpu.memory_gib - peak.total_bytes / GIB
    verdict = "fits" if room >= 0.1 * s.gpu.memory_gib else ("tight" if room >= 0 else "DOES NOT FIT")
    add(f"  peak {peak.total_bytes / GIB:.1f} GiB on stage {peak.stage} vs {s.gpu.name} {s.gpu.memory_gib:.0f} GiB: "
        f"{verdict} ({room:+.1f} GiB left for TE workspaces, NCCL buffers, SNIP probes, fragmentation)")
    out += checkpoint_lines(s)  # checkpoint_time.py
    add("")
    add("FLOPs per step (global batch, all blocks; each linear runs fprop, dgrad and wgrad)")
    for lin in LINEARS:
        add(f"  {lin:<10}" + "   ".join(f"{gemm} {_flops(s.flops[f'{lin}.{gemm}'])}" for gemm in GEMMS))
    add(f"  {'lm_head':<10}" + "   ".join(f"{gemm} {_flops(s.flops[f'lm_head.{gemm}'])}" for gemm in GEMMS))
    add(f"  {'attention':<10}fwd   {_flops(s.flops['attention.fwd'])}   bwd   {_flops(s.flops['attention.bwd'])}"
        f"   (non-causal convention; causal kernels do about half)")
    add(f"  total {_flops(s.flops_total).strip()} = 6*T*(non-embedding, non-norm params) + 12*T*s*h*hd*L; "
        f"block linears {s.flops_linear / s.flops_total:.1%} (the FP4-share denominator)")
    add(f"  per GPU: stage 0 {_flops(s.stages[0].flops).strip()}"
        + (f", last stage {_flops(s.stages[-1].flops).strip()} (LM head)" if s.pp > 1 else ""))
    add("")
    state = "enabled" if sn.enabled else "disabled (sized as if enabled)"
    add(f"SNIP        {state}: granularity {sn.granularity} -> {sn.units} decision units, candidates "
        f"{list(sn.formats)}, target FP4 share {cfg.snip.fp4_target:g}")
    add(f"  ILP: {sn.booleans} Booleans (" + ", ".join(f"{f} on {n}" for f, n in sn.allowed.items())
        + f"), {sn.constraints} constraints ({sn.exactly_one} exactly-one + {sn.fp4_floors} "
        + f"FP4 floor{'s' if sn.fp4_floors != 1 else ''}"
        + (f": 1 global + {s.pp} per stage" if sn.fp4_floors > 1 else "")
        + (f" + {sn.time_caps} GEMM-time cap{'s' if sn.time_caps != 1 else ''}" if sn.time_caps else "") + ")")
    if sn.max_fp4_share < 1.0 and any(f in FP4_FORMATS for f in sn.formats):
        add(f"  block divisibility leaves at most {sn.max_fp4_share:.1%} of linear FLOPs reachable in FP4")
    out += gemm_time_lines(cfg, s)  # gemm_time.py
    out += schedule_lines(cfg)  # snip/budget.py: the run-level FP4 budget, when snip.budget = "run"
    add("")
    gpu_src = ("argument gpu" if gpu else f"${GPU_ENV}" if os.environ.get(GPU_ENV)
               else f"default; set {GPU_ENV}=" + "|".join(GPUS))
    add(f"backend     {s.backend} on {s.gpu.name} (sm_{s.gpu.sm[0]}{s.gpu.sm[1]}, {gpu_src}):")
    for fmt, (ok, why) in s.support.items():
        add(f"  {fmt:<10}{'ok  ' if ok else 'NO  '} {why}")
    if not all(ok for ok, _ in s.support.values()):
        add("  -> this config cannot run on this GPU as configured; the run would stop at start-up")
    return "\n".join(out)

