"""FLOP accounting of a Llama block's linear layers, from model dimensions.

The SNIP efficiency target is a share of *linear-layer training FLOPs* (see
``precision/plan.fp4_flops_share``). A linear with weight W of shape (N, K) run on
T tokens costs 2*T*K*N FLOPs in each of its three GEMMs (fprop Y = X·Wᵀ,
dgrad dX = dY·W, wgrad dW = dYᵀ·X), so within a model every GEMM's weight in the
share is its linear's K*N and T cancels.

Only the four linears of a transformer block are counted: ``qkv``, ``proj``,
``fc1`` (fused gate+up) and ``fc2`` (down). The embedding, the LM head, the
attention score/context matmuls, norms and activations are NOT included - they
stay BF16 and are outside the decision (SNIP paper: linears carry > 90% of
training FLOPs).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_snip.precision.plan import GEMMS, LINEARS


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


def model_linear_shapes(model_cfg) -> dict[str, tuple[int, int]]:
    """``linear_shapes`` of a ``config.ModelConfig``."""
    return linear_shapes(model_cfg.hidden_size, model_cfg.ffn_hidden_size, model_cfg.num_attention_heads,
                         model_cfg.num_kv_heads, model_cfg.head_dim)


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
