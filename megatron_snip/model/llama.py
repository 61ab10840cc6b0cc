"""Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU - in Megatron's fused layout.

Per block: ``qkv`` (fused Q, K, V projection), ``proj`` (attention output),
``fc1`` (fused gate+up), ``fc2`` (down). Those four are ``PrecisionLinear``s named
by their global block index; embedding and LM head are untied and stay in the
training dtype. Blocks live in a ``ModuleDict`` keyed by the *global* block index,
so a pipeline stage holding blocks 8..15 has the same parameter names as the full
model.

Shape legend: B batch, S sequence, D hidden, H query heads, G kv heads
(groups), Hd head dim, F ffn hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megatron_snip.config import ModelConfig
from megatron_snip.model.layers import PrecisionLinear, scaled_init_std
from megatron_snip.model.norm import RMSNorm
from megatron_snip.model.rope import apply_rope, rope_tables
from megatron_snip.precision.plan import LINEARS, GemmId, PrecisionPlan, all_gemm_ids


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    return ((vocab_size + multiple - 1) // multiple) * multiple


class Attention(nn.Module):
    """Causal GQA self-attention.

    The fused qkv output is laid out per kv group as [q_0..q_{H/G-1}, k, v] (Megatron's
    layout), so tensor parallelism can shard whole groups along the output dim.
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_groups, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        q_per_group = self.num_heads // self.num_groups
        qkv_out = self.num_groups * (q_per_group + 2) * self.head_dim
        self.qkv = PrecisionLinear(cfg.hidden_size, qkv_out, layer=layer, linear="qkv", init_std=cfg.init_std)
        self.proj = PrecisionLinear(self.num_heads * self.head_dim, cfg.hidden_size, layer=layer, linear="proj",
                                    init_std=scaled_init_std(cfg.init_std, cfg.num_layers))

    def forward(self, x_bsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_bsd.shape
        q_per_group = self.num_heads // self.num_groups
        qkv = self.qkv(x_bsd).view(b, s, self.num_groups, q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :q_per_group].reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # B H S Hd
        k = qkv[:, :, :, q_per_group].transpose(1, 2)  # B G S Hd
        v = qkv[:, :, :, q_per_group + 1].transpose(1, 2)  # B G S Hd
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_groups != self.num_heads)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """fc2(silu(gate) * up) with fc1 producing [gate; up] along its output dim."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.fc1 = PrecisionLinear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, layer=layer, linear="fc1", init_std=cfg.init_std)
        self.fc2 = PrecisionLinear(cfg.ffn_hidden_size, cfg.hidden_size, layer=layer, linear="fc2",
                                   init_std=scaled_init_std(cfg.init_std, cfg.num_layers))

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x_bsd).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, layer)

    def forward(self, x_bsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, layers: Iterable[int] | None = None,
                 pre_process: bool = True, post_process: bool = True) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.layer_ids = list(range(cfg.num_layers) if layers is None else layers)
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.embedding = nn.Embedding(vocab_size, cfg.hidden_size)
            nn.init.normal_(self.embedding.weight, std=cfg.init_std)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in self.layer_ids})
        if post_process:
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
            nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
        self._rope_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

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

    def set_quant_generator(self, generator: torch.Generator | None) -> None:
        for lin in self.precision_linears():
            lin.generator = generator

    # --- forward ----------------------------------------------------------------
    def _rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, device)
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(seq_len, self.cfg.head_dim, self.cfg.rope_base, device)
        return self._rope_cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) int64 -> hidden (B, S, D) on the first stage; hidden in/out on middle
        stages; logits (B, S, V) fp32 on the last stage."""
        h = self.embedding(x) if self.pre_process else x
        cos, sin = self._rope(h.shape[1], h.device)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if not self.post_process:
            return h
        return self.lm_head(self.final_norm(h)).float()


def cross_entropy_loss(logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in nats (fp32)."""
    return F.cross_entropy(logits_bsv.reshape(-1, logits_bsv.shape[-1]).float(), targets_bs.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["LlamaModel", "cross_entropy_loss", "count_parameters", "pad_vocab", "LINEARS"]
