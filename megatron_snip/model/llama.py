"""Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU - in Megatron's fused layout.

Per block: ``qkv`` (fused Q, K, V projection), ``proj`` (attention output),
``fc1`` (fused gate+up), ``fc2`` (down). Those four are ``PrecisionLinear``s named
by their global block index; embedding and LM head are untied and stay in the
training dtype. Blocks live in a ``ModuleDict`` keyed by the *global* block index,
so a pipeline stage holding blocks 8..15 has the same parameter names as the full
model.

Tensor parallelism (``tp``, a ``TensorParallel``): qkv and fc1 are column-parallel, proj
and fc2 row-parallel, embedding, LM head and loss vocab-parallel; each rank holds H/tp query
heads, G/tp kv groups, F/tp ffn features and V/tp vocabulary rows. With sequence
parallelism the residual stream between TP regions is (B, S/tp, D). Weights are initialized
from per-parameter generators (``layers.init_generator``), so any TP/PP layout holds exact
slices of the TP=1/PP=1 model built after the same ``torch.manual_seed``.

Shape legend: B batch, S sequence, D hidden, H query heads, G kv heads
(groups), Hd head dim, F ffn hidden, V vocab (all local under TP: H/tp, G/tp, F/tp, V/tp).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_snip.config import RECOMPUTE_MODES, ModelConfig
from megatron_snip.model import compiled_regions
from megatron_snip.model.layers import (
    UNSHARDED,
    ColumnParallelLinear,
    ParallelLMHead,
    PrecisionLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_generator,
    scaled_init_std,
    shard_state_dict,
    unshard_state_dicts,
    vocab_parallel_cross_entropy,
)
from megatron_snip.model.norm import RMSNorm
from megatron_snip.model.recompute import recompute_allowed, recompute_cheap
from megatron_snip.model.rope import Llama3RopeScaling, rope_tables
from megatron_snip.model.shapes import model_linear_shapes
from megatron_snip.parallel.sequence_shard import prefetch_chain
from megatron_snip.parallel.topology import TensorParallel
from megatron_snip.precision.backends import Backend
from megatron_snip.precision.gemm import activation_dtype
from megatron_snip.precision.gemm_shapes import gemm_shape_error
from megatron_snip.precision.plan import GEMMS, LINEARS, GemmId, PrecisionPlan, all_gemm_ids


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    return ((vocab_size + multiple - 1) // multiple) * multiple


class Attention(nn.Module):
    """Causal GQA self-attention.

    The fused qkv output is laid out per kv group as [q_0..q_{H/G-1}, k, v] (Megatron's
    layout), so tensor parallelism shards whole groups: rank r's contiguous slice of the
    output dim is groups [r·G/tp, (r+1)·G/tp) and their query heads.
    """

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = UNSHARDED, seed: int | None = None) -> None:
        super().__init__()
        if cfg.num_kv_heads % tp.size:
            raise ValueError(f"config model.num_kv_heads={cfg.num_kv_heads} must be divisible by parallel.tp={tp.size}")
        self.num_heads, self.num_groups = cfg.num_attention_heads // tp.size, cfg.num_kv_heads // tp.size  # local
        self.head_dim = cfg.head_dim
        # (N, K) = (out, in): qkv G·(H/G+2)·Hd = (H+2G)·Hd outputs of D, proj D outputs of H·Hd
        (qkv_out, qkv_in), (proj_out, proj_in) = (model_linear_shapes(cfg)[lin] for lin in ("qkv", "proj"))
        self.qkv = ColumnParallelLinear(qkv_in, qkv_out, layer=layer, linear="qkv", init_std=cfg.init_std, tp=tp,
                                        init_generator=_gen(seed, f"layers.{layer}.attn.qkv.weight"))
        self.proj = RowParallelLinear(proj_in, proj_out, layer=layer, linear="proj",
                                      init_std=scaled_init_std(cfg.init_std, cfg.num_layers), tp=tp,
                                      init_generator=_gen(seed, f"layers.{layer}.attn.proj.weight"))
        self.recompute_core = False  # set by LlamaModel.set_recompute
        self.compiled = False  # set by LlamaModel.set_compile

    def forward(self, x_bsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, S, D) [(B, S/tp, D) with sequence parallelism] -> same shape."""
        qkv = self.qkv(x_bsd)  # (B, S, G·(H/G+2)·Hd): full sequence even under sequence parallelism
        if self.recompute_core and recompute_allowed():
            # Selective recompute: keep only qkv; RoPE and attention re-run in backward.
            out = checkpoint(self._core, qkv, cos, sin, use_reentrant=False)
        else:
            out = self._core(qkv, cos, sin)
        return self.proj(out)

    def _core(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Core attention (no weights): qkv (B, S, G·(H/G+2)·Hd) -> (B, S, H·Hd), causal, RoPE on q and k."""
        args = (qkv, cos, sin, self.num_heads, self.num_groups, self.head_dim)
        if self.compiled:  # training.compile (model/compiled_regions.py)
            return compiled_regions.run(compiled_regions.attention_core, *args)
        return compiled_regions.attention_core(*args)


class SwiGLU(nn.Module):
    """fc2(silu(gate) * up) with fc1 producing [gate; up] along its output dim.

    Memory: silu(gate) * up is recomputed in backward (``recompute_cheap``), so the block saves
    fc1's output (gate and up) and fc2's input, not silu(gate) as well - Megatron's fused
    bias-SwiGLU saves the same.
    """

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = UNSHARDED, seed: int | None = None) -> None:
        super().__init__()
        # (N, K) = (out, in): fc1 (2F, D) = [gate; up], fc2 (D, F)
        (fc1_out, fc1_in), (fc2_out, fc2_in) = (model_linear_shapes(cfg)[lin] for lin in ("fc1", "fc2"))
        # partitions=2: gate and up are sharded separately, so the local output is [gate_r; up_r].
        self.fc1 = ColumnParallelLinear(fc1_in, fc1_out, layer=layer, linear="fc1",
                                        init_std=cfg.init_std, tp=tp, partitions=2,
                                        init_generator=_gen(seed, f"layers.{layer}.mlp.fc1.weight"))
        self.fc2 = RowParallelLinear(fc2_in, fc2_out, layer=layer, linear="fc2",
                                     init_std=scaled_init_std(cfg.init_std, cfg.num_layers), tp=tp,
                                     init_generator=_gen(seed, f"layers.{layer}.mlp.fc2.weight"))
        self.compiled = False  # set by LlamaModel.set_compile

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        gate_up = self.fc1(x_bsd)
        if self.compiled:  # training.compile (model/compiled_regions.py)
            return self.fc2(compiled_regions.run(compiled_regions.swiglu, gate_up))
        return self.fc2(recompute_cheap(compiled_regions.swiglu, gate_up))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = UNSHARDED, seed: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel=tp.sequence_parallel)
        self.attn = Attention(cfg, layer, tp, seed)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel=tp.sequence_parallel)
        self.mlp = SwiGLU(cfg, layer, tp, seed)
        self.recompute = False  # full recompute of this block; set by LlamaModel.set_recompute

    def forward(self, x_bsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # SNIP's probes act in forward (record X/Y, hook G, draw noise): a recomputed forward would
        # repeat those side effects, so probe passes run this block without recompute.
        probed = any(lin.probe is not None for lin in (self.attn.qkv, self.attn.proj, self.mlp.fc1, self.mlp.fc2))
        if self.recompute and torch.is_grad_enabled() and not probed:
            return checkpoint(self._forward, x_bsd, cos, sin, use_reentrant=False)
        return self._forward(x_bsd, cos, sin)

    def _forward(self, x_bsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_bsd = x_bsd + self.attn(self.attn_norm(x_bsd), cos, sin)
        return x_bsd + self.mlp(self.mlp_norm(x_bsd))


class LlamaModel(nn.Module):
    """A Llama model, or one pipeline stage of it.

    Args:
        cfg: architecture.
        vocab_size: (padded) vocabulary size V.
        layers: global indices of the blocks this stage holds (default: all).
        pre_process: this stage owns the embedding (first stage).
        post_process: this stage owns the final norm and LM head (last stage).
        tp: tensor-parallel group/size/rank and sequence parallelism (default: unsharded).
        seed: weight-init seed; None draws one from the global RNG (so ``torch.manual_seed(s)``
            before construction makes the model deterministic). Every parameter gets its own
            generator keyed by its global name: stages and TP shards agree with the full model.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, layers: Iterable[int] | None = None,
                 pre_process: bool = True, post_process: bool = True, tp: TensorParallel = UNSHARDED,
                 seed: int | None = None) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.tp = cfg, vocab_size, tp
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        self.layer_ids = list(range(cfg.num_layers) if layers is None else layers)
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.embedding = VocabParallelEmbedding(vocab_size, cfg.hidden_size, init_std=cfg.init_std, tp=tp,
                                                    init_generator=_gen(seed, "embedding.weight"))
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, tp, seed) for i in self.layer_ids})
        if post_process:
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel=tp.sequence_parallel)
            self.lm_head = ParallelLMHead(cfg.hidden_size, vocab_size, init_std=cfg.init_std, tp=tp,
                                          init_generator=_gen(seed, "lm_head.weight"))
        self._rope_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.compiled_loss = False  # set by set_compile (training.compile)

    # --- precision seam ---------------------------------------------------------
    def precision_linears(self) -> Iterator[PrecisionLinear]:
        for block in self.layers.values():
            yield from (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2)

    def gemm_ids(self) -> list[GemmId]:
        """GemmIds of the GEMMs this stage owns."""
        return all_gemm_ids(self.cfg.num_layers, self.layer_ids)

    def apply_plan(self, plan: PrecisionPlan) -> None:
        """Set every owned linear's GEMM formats from ``plan`` (call at a step boundary)."""
        for lin in self.precision_linears():
            lin.set_precision(plan.for_linear(lin.layer, lin.linear))

    def plan_shape_errors(self, plan: PrecisionPlan, tokens: int) -> list[str]:
        """Why ``plan`` cannot run on this stage's *local* GEMM shapes (empty list: it can).

        ``tokens`` = T, tokens per micro-batch (micro_batch_size * seq_len; the full sequence
        even under sequence parallelism, since column-parallel inputs are gathered first).
        One message per GEMM that does not fit (rules: ``precision/gemm_shapes.py``).
        """
        errors = []
        for lin in self.precision_linears():
            n, k = lin.out_features, lin.in_features
            prec = plan.for_linear(lin.layer, lin.linear)
            for gemm in GEMMS:
                error = gemm_shape_error(prec[gemm], gemm, n, k, tokens)
                if error is not None:
                    errors.append(f"{lin.layer}.{lin.linear}.{gemm}={prec[gemm]} (local weight {n}x{k}, "
                                  f"tp={lin.tp.size}, T={tokens}): {error}")
        return errors

    def set_quant_generator(self, generator: torch.Generator | None) -> None:
        for lin in self.precision_linears():
            lin.generator = generator

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """Activation recompute (``training.recompute``): "none"; "selective" re-runs each block's
        core attention (RoPE + softmax(QKᵀ)V) in backward; "full" keeps only the input of every
        ``every``-th block of this stage (local positions 0, every, 2·every, ...) and re-runs the
        whole block in backward. Non-reentrant ``torch.utils.checkpoint`` with the RNG state
        preserved; the forward draws no random numbers (stochastic rounding is backward-only),
        so losses and gradients are bitwise those without recompute."""
        if mode not in RECOMPUTE_MODES or every < 1:
            raise ValueError(f"recompute mode={mode!r} every={every}: choose one of {RECOMPUTE_MODES}, every >= 1")
        for j, block in enumerate(self.layers.values()):
            block.recompute = mode == "full" and j % every == 0
            block.attn.recompute_core = mode == "selective"
            # The SP shard-saving hooks would shadow the checkpoint's own (parallel/sequence_shard.py).
            block.attn.qkv.save_input_shard = block.mlp.fc1.save_input_shard = not block.recompute
            # A recomputed block keeps no weight copy between its passes; a step-long cache would.
            for lin in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2):
                lin.weight_copy.enabled = not block.recompute

    def set_compile(self, enabled: bool) -> None:
        """``training.compile``: run every norm, core attention and SwiGLU of this stage, and the loss
        without TP, through their compiled graphs (``model/compiled_regions.py``; the linears stay eager)."""
        for block in self.layers.values():
            block.attn_norm.compiled = block.mlp_norm.compiled = enabled
            block.attn.compiled = block.mlp.compiled = enabled
        if self.post_process:
            self.final_norm.compiled = self.compiled_loss = enabled

    @contextmanager
    def weight_copies_for_step(self) -> Iterator[None]:
        """Inside: each linear on the reference path and the LM head make their activation-dtype
        weight copy once and share it across micro-batches (precision/weight_copies.py); on exit the
        copies are dropped, and so is what each backend kept for the step (``Backend.end_step``: the torch
        backend's quantized weights). Wrap a step's forward and backward passes, never an optimizer step."""
        copies = [lin.weight_copy for lin in self.precision_linears()]
        if self.post_process:
            copies.append(self.lm_head.weight_copy)
        for c in copies:
            c.open()
        try:
            yield
        finally:
            for c in copies:
                c.close()
            for backend in {id(lin.backend): lin.backend for lin in self.precision_linears()}.values():
                backend.end_step()  # e.g. the torch backend's quantized weights: stale once the optimizer steps

    def set_backend(self, backend: Backend) -> None:
        """Run every linear's GEMMs through ``backend`` (emulated or Transformer Engine)."""
        for lin in self.precision_linears():
            lin.backend = backend

    def set_tp_amax(self, mode: str) -> None:
        """``precision.tp_amax`` for every linear: "tensor" or "shard" (``PrecisionLinear.set_tp_amax``)."""
        for lin in self.precision_linears():
            lin.set_tp_amax(mode)

    # --- forward ----------------------------------------------------------------
    def _rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, device)
        if key not in self._rope_cache:
            c = self.cfg
            scaling = (Llama3RopeScaling(c.rope_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor,
                                         c.rope_original_max_position) if c.rope_scaling == "llama3" else None)
            self._rope_cache[key] = rope_tables(seq_len, c.head_dim, c.rope_base, device, scaling)
        return self._rope_cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) int64 -> hidden (B, S, D) on the first stage; hidden in/out on middle
        stages; logits (B, S, V) fp32 on the last stage. Hidden states come out in the activation
        dtype (``gemm.activation_dtype``: bf16 under autocast) and go in as any float dtype.

        Under TP the logits are this rank's vocabulary slice (B, S, V/tp) (use ``loss``), and
        with sequence parallelism hidden states are (B, S/tp, D)."""
        h = self.embedding(x) if self.pre_process else x
        # The residual stream runs in the activation dtype (bf16 under autocast, as Megatron's
        # default without fp32_residual_connection): its adds, the norms' saved inputs and the
        # stage-to-stage activations are then bf16. A no-op in fp32.
        h = h.to(activation_dtype(h))
        seq_len = h.shape[1] * (self.tp.size if self.tp.sequence_parallel else 1)
        cos, sin = self._rope(seq_len, h.device)
        # Under SP each block's saved input shards are re-gathered in backward; the chain lets each
        # re-gather start one saved input ahead, overlapping backward's compute (parallel/sequence_shard.py).
        with prefetch_chain():
            for block in self.layers.values():
                h = block(h, cos, sin)
        if not self.post_process:
            return h
        return self.lm_head(self.final_norm(h)).float()

    def loss(self, logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        """Mean token cross entropy (fp32) of ``forward``'s logits; vocab-parallel under TP."""
        return vocab_parallel_cross_entropy(logits_bsv, targets_bs, self.tp, compiled=self.compiled_loss)

    # --- tensor-parallel layout ------------------------------------------------------------
    def tp_shard_spec(self) -> dict[str, tuple[int, int] | None]:
        """Parameter name -> (dim, partitions) it is split along under TP, or None if replicated."""
        spec: dict[str, tuple[int, int] | None] = {name: None for name, _ in self.named_parameters()}
        for mname, mod in self.named_modules():
            if isinstance(mod, PrecisionLinear) and mod.shard_dim is not None:
                spec[f"{mname}.weight"] = (mod.shard_dim, mod.partitions)
            elif isinstance(mod, (VocabParallelEmbedding, ParallelLMHead)):
                spec[f"{mname}.weight"] = (0, 1)
        return spec

    def sharded_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of an unsharded model state dict (for this stage's parameters)."""
        mine = {k: v for k, v in full.items() if k in dict(self.named_parameters())}
        return shard_state_dict(mine, self.tp_shard_spec(), self.tp.size, self.tp.rank)

    def unsharded_state_dict(self, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The unsharded state dict from every TP rank's ``state_dict()`` (in TP-rank order)."""
        return unshard_state_dicts(shards, self.tp_shard_spec())


def _gen(seed: int | None, name: str) -> torch.Generator | None:
    return None if seed is None else init_generator(seed, name)


def cross_entropy_loss(logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in nats (fp32) of full-vocabulary logits (see LlamaModel.loss under TP)."""
    return F.cross_entropy(logits_bsv.reshape(-1, logits_bsv.shape[-1]).float(), targets_bs.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["LINEARS", "LlamaModel", "count_parameters", "cross_entropy_loss", "pad_vocab"]
