"""Rotary position embeddings (Su et al. 2021), Llama's rotate-half convention."""

from __future__ import annotations

import torch


def rope_tables(seq_len: int, head_dim: int, base: float, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (seq_len, head_dim), fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # (S, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (S, head_dim)
    return emb.cos(), emb.sin()


def apply_rope(x_bhsd: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, S, head_dim) by the position tables (S, head_dim)."""
    half = x_bhsd.shape[-1] // 2
    x1, x2 = x_bhsd[..., :half], x_bhsd[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_bhsd * cos_sd + rotated * sin_sd).to(x_bhsd.dtype)
