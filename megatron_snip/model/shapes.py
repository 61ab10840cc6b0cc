"""Shapes, parameter counts and FLOPs of the Llama model, from its dimensions alone.

The one home of these facts (torchtitan's ``get_nparams_and_flops``): the model builds
its linears from ``model_linear_shapes``, the dry run (``sizing/``) sizes memory and
FLOPs from them, and SNIP weighs each GEMM by ``linear_numel``. Nothing here builds a
module or touches a device.

A block's four linears, weight W of shape (N, K) = (out_features, in_features):
``qkv`` (fused Q, K, V), ``proj`` (attention output), ``fc1`` (fused gate+up), ``fc2``
(down). Run on T tokens each of its three GEMMs (fprop Y = X·Wᵀ, dgrad dX = dY·W, wgrad
dW = dYᵀ·X) costs 2*T*K*N FLOPs, so within a model a GEMM's weight in the FP4 FLOP share
(``precision/plan.fp4_flops_share``) is its linear's K*N and T cancels. The embedding,
the LM head, the attention score/context matmuls, norms and activations are not decision
units - they stay BF16 (SNIP paper: linears carry > 90% of training FLOPs).

Under tensor parallelism qkv and fc1 are column-parallel (N sharded) and proj and fc2
row-parallel (K sharded); ``local_linear_shapes`` gives one rank's (N, K).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_snip.config import ModelConfig
from megatron_snip.precision.plan import GEMMS, LINEARS

COLUMN_PARALLEL = frozenset({"qkv", "fc1"})  # sharded along N (out); proj and fc2 along K (in)
NORMS_PER_BLOCK = 2  # RMSNorm weights of d before attention and before the MLP


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def linear_shapes(
    hidden: int,
    ffn_hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,
) -> dict[str, tuple[int, int]]:
    """Unsharded weight shapes (N, K) = (out_features, in_features) of one block's linears.

    Args:
        hidden: model width d.
        ffn_hidden: SwiGLU inner width f (each of gate and up has f outputs).
        num_heads: query heads h.
        num_kv_heads: key/value heads (GQA); must divide ``num_heads``.
        head_dim: per-head width; defaults to ``hidden // num_heads``.

    Returns:
        ``{"qkv": ((h + 2*kv)*head_dim, d), "proj": (d, h*head_dim),
        "fc1": (2*f, d), "fc2": (d, f)}`` - fc1 is the fused gate+up projection.
        Embedding and LM head are not included (they are not decision units).
    """
    _positive_int("hidden", hidden)
    _positive_int("ffn_hidden", ffn_hidden)
    _positive_int("num_heads", num_heads)
    _positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (grouped-query attention); "
            f"pick a divisor of {num_heads}"
        )
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(
                f"hidden={hidden} is not divisible by num_heads={num_heads}; pass head_dim explicitly"
            )
        head_dim = hidden // num_heads
    _positive_int("head_dim", head_dim)
    return {
        "qkv": ((num_heads + 2 * num_kv_heads) * head_dim, hidden),
        "proj": (hidden, num_heads * head_dim),
        "fc1": (2 * ffn_hidden, hidden),
        "fc2": (hidden, ffn_hidden),
    }


def model_linear_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``linear_shapes`` of a ``config.ModelConfig``."""
    return linear_shapes(model_cfg.hidden_size, model_cfg.ffn_hidden_size, model_cfg.num_attention_heads,
                         model_cfg.num_kv_heads, model_cfg.head_dim)


def local_linear_shapes(shapes: Mapping[str, tuple[int, int]], tp: int) -> dict[str, tuple[int, int]]:
    """One tensor-parallel rank's (N, K) of each linear: N/tp for qkv and fc1, K/tp for proj and fc2."""
    _check_shapes(shapes)
    _positive_int("tp", tp)
    return {lin: ((n // tp, k) if lin in COLUMN_PARALLEL else (n, k // tp)) for lin, (n, k) in shapes.items()}


def _check_shapes(shapes: Mapping[str, tuple[int, int]]) -> None:
    missing = [lin for lin in LINEARS if lin not in shapes]
    if missing:
        raise ValueError(f"linear shapes are missing {missing}; expected an (N, K) pair for each of {LINEARS}")
    for lin in LINEARS:
        n_k = shapes[lin]
        if len(n_k) != 2:
            raise ValueError(f"shape of linear {lin!r} is {n_k!r}; expected (N, K)")
        _positive_int(f"shapes[{lin!r}][0] (N)", n_k[0])
        _positive_int(f"shapes[{lin!r}][1] (K)", n_k[1])


def linear_numel(shapes: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """K*N per linear: the FLOP weight of each of the linear's GEMMs (the ``linear_numel`` plans use)."""
    _check_shapes(shapes)
    return {lin: shapes[lin][0] * shapes[lin][1] for lin in LINEARS}


def gemm_flops(shapes: Mapping[str, tuple[int, int]], tokens: int) -> dict[str, int]:
    """FLOPs of ONE GEMM (any of fprop/dgrad/wgrad) of each linear on ``tokens`` tokens: 2*T*K*N.

    The three GEMMs of a linear cost the same. Embedding and LM head excluded.
    """
    _positive_int("tokens", tokens)
    return {lin: 2 * tokens * numel for lin, numel in linear_numel(shapes).items()}


def linear_flops_per_step(shapes: Mapping[str, tuple[int, int]], tokens: int, num_layers: int) -> int:
    """Training FLOPs of all block linears in one step: num_layers * 3 GEMMs * sum_linear 2*T*K*N.

    ``tokens`` is the global number of tokens per step (micro-batch x seq x
    micro-batches x DP). Embedding, LM head and attention score/context matmuls
    are excluded - this is the denominator of the FP4 FLOP share.
    """
    _positive_int("num_layers", num_layers)
    return num_layers * len(GEMMS) * sum(gemm_flops(shapes, tokens).values())


def lm_head_gemm_flops(model_cfg: ModelConfig, vocab_size: int, tokens: int) -> int:
    """FLOPs of ONE GEMM of the untied LM head, weight (V, d), on ``tokens`` tokens: 2*T*d*V."""
    return 2 * _positive_int("tokens", tokens) * model_cfg.hidden_size * _positive_int("vocab_size", vocab_size)


def attention_flops(model_cfg: ModelConfig, tokens: int, seq_len: int) -> int:
    """Forward FLOPs of one block's score (Q·Kᵀ) and context (P·V) matmuls: 4*T*s*h*hd.

    The non-causal convention of Megatron/PaLM MFU (causal kernels skip about half);
    backward costs twice this. GQA does not change it: every query head attends.
    """
    return (4 * _positive_int("tokens", tokens) * _positive_int("seq_len", seq_len)
            * model_cfg.num_attention_heads * model_cfg.head_dim)


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of an unsharded model (untied embedding and LM head).

    Attributes:
        embedding: V*d.
        block_linears: one block's qkv + proj + fc1 + fc2 (sum of ``linear_numel``).
        block_norms: one block's two RMSNorm weights, 2*d (replicated under TP).
        num_layers: blocks.
        lm_head: V*d.
        final_norm: d.
    """

    embedding: int
    block_linears: int
    block_norms: int
    num_layers: int
    lm_head: int
    final_norm: int

    @property
    def block(self) -> int:
        return self.block_linears + self.block_norms

    @property
    def blocks(self) -> int:
        return self.num_layers * self.block

    @property
    def total(self) -> int:
        return self.embedding + self.blocks + self.lm_head + self.final_norm


def parameter_counts(model_cfg: ModelConfig, vocab_size: int) -> ParameterCounts:
    """``ParameterCounts`` of ``model_cfg`` with a (padded) vocabulary of ``vocab_size``."""
    d = model_cfg.hidden_size
    _positive_int("vocab_size", vocab_size)
    return ParameterCounts(
        embedding=vocab_size * d,
        block_linears=sum(linear_numel(model_linear_shapes(model_cfg)).values()),
        block_norms=NORMS_PER_BLOCK * d,
        num_layers=model_cfg.num_layers,
        lm_head=vocab_size * d,
        final_norm=d,
    )
