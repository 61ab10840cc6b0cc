"""Rotary position embeddings (Su et al. 2021), Llama's rotate-half convention, with Llama 3's
frequency scaling as an option.

Layout: a head vector's two halves [x1, x2] are rotated as complex pairs (x1_i, x2_i) - the
"rotate_half" convention of Hugging Face's Llama, not the interleaved pairs (x_2i, x_2i+1) of
Meta's original checkpoints (HF's conversion permutes q/k rows into this layout, so HF weights
load unchanged; see interop/hf.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE scaling (HF ``rope_type="llama3"``): wavelengths longer than
    ``original_max_position / low_freq_factor`` are stretched by ``factor``, shorter than
    ``original_max_position / high_freq_factor`` kept, and those between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Scaled inverse frequencies, (head_dim/2,) fp32 -> same (operation order as HF's, for equal bits)."""
        low_freq_wavelen = self.original_max_position / self.low_freq_factor
        high_freq_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def rope_tables(seq_len: int, head_dim: int, base: float, device: torch.device | None = None,
                scaling: Llama3RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (seq_len, head_dim), fp32; ``scaling`` None = plain RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
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
