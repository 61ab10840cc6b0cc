"""RMSNorm (Zhang & Sennrich 2019), as in Llama."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalized over the last dim (hidden_size); computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        x32 = x_bsd.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x_bsd.dtype)
