"""Measured activation memory: the bytes one block saves for backward, per token.

``measure_block(trainer, layer)`` runs one micro-batch forward and backward through the whole
model (``Trainer.forward_loss``: a single-stage layout) with a ``saved_tensors_hooks`` context
around block ``layer``'s forward, and counts every distinct storage the block saves, except the
parameters and the model's cached RoPE tables (held anyway). Weight-shaped saved tensors
(autocast's BF16 weight copies: per micro-batch or per step, not per token) and tensors the core
attention saves with an (S, S) pair as their last dims (attention probabilities, which a math
SDPA kernel saves and flash attention does not) are reported apart. The backward runs too, so
that recompute frees and re-makes its tensors.

``sizing.activation_bytes`` is the formula; tests/unit/test_activation_memory.py requires the two
to agree and ``python -m experiments.bench.memory`` prints them side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SavedBytes", "measure_block"]


@dataclass(frozen=True)
class SavedBytes:
    """What block ``layer`` saved for backward in one micro-batch of ``tokens`` tokens.

    Attributes:
        activations: bytes of the saved storages that are neither weight copies nor (S, S).
        square: bytes of saved storages whose last two dims are (S, S) (attention probabilities).
        weight_copies: bytes of weight-shaped saved storages (the block's autocast weight copies).
        tokens: T = micro-batch x sequence length.
    """

    activations: int
    square: int
    weight_copies: int
    tokens: int

    @property
    def per_token(self) -> float:
        """Activation bytes per token (square apart)."""
        return self.activations / self.tokens

    @property
    def square_per_token(self) -> float:
        return self.square / self.tokens


def measure_block(trainer, layer: int = 1, tokens: torch.Tensor | None = None) -> SavedBytes:
    """Saved-for-backward bytes of block ``layer`` on one micro-batch ``tokens`` (B, S+1) int64
    (default: the trainer's first micro-batch of step 0). ``trainer`` holds the whole model."""
    model = trainer.model
    block = model.layers[str(layer)]
    if tokens is None:
        tokens = trainer.micro_batches(0)[0]
    seq = tokens.shape[1] - 1
    cos, sin = model._rope(seq, trainer.device)
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    weight_shapes = {s for p in block.parameters() for s in (tuple(p.shape), tuple(p.t().shape))}
    saved: dict[int, tuple[int, str]] = {}  # storage -> (bytes, kind)
    in_core = [False]  # inside the attention core, where (S, S) can only be probabilities

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in held:
            shape = tuple(t.shape)
            kind = ("weight" if shape in weight_shapes else
                    "square" if in_core[0] and shape[-2:] == (seq, seq) else "activation")
            saved[st.data_ptr()] = (st.nbytes(), kind)
        return t

    real_forward, real_core = block.forward, block.attn._core

    def forward(*args):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return real_forward(*args)

    def core(*args):
        in_core[0] = True
        try:
            return real_core(*args)
        finally:
            in_core[0] = False

    block.forward, block.attn._core = forward, core
    try:
        trainer.forward_loss(tokens).backward()
    finally:
        del block.forward, block.attn._core  # back to the classes' methods
    total = {k: sum(n for n, kind in saved.values() if kind == k) for k in ("activation", "square", "weight")}
    return SavedBytes(activations=total["activation"], square=total["square"], weight_copies=total["weight"],
                      tokens=tokens.shape[0] * seq)
