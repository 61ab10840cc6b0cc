"""RMSNorm (Zhang & Sennrich 2019), as in Llama."""

from __future__ import annotations

import torch
from torch import nn

from megatron_snip.model import compiled_regions
from megatron_snip.model.recompute import recompute_cheap


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalized over the last dim (hidden_size); computed in fp32.

    The weight is replicated over tensor parallelism. With sequence parallelism each TP rank
    sees a different slice of the sequence, so its weight gradient is partial: the weight is
    marked ``sequence_parallel`` and parallel/ddp.py sums its gradient over the TP group.

    Memory: saves only its input x (the residual stream, in its dtype: bf16 under autocast) and
    recomputes 1/rms and the normalized fp32 rows in backward (``recompute_cheap``; the
    weight is held anyway) - what Megatron's activation count assumes for a norm, and bitwise
    the gradients of saving them.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.weight.tensor_parallel = False  # type: ignore[attr-defined]
        self.weight.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        self.compiled = False  # set by LlamaModel.set_compile

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        """x (..., D) any float dtype -> (..., D) in x's dtype, normalized in fp32."""
        if self.compiled:  # training.compile: one graph for every norm (model/compiled_regions.py)
            return compiled_regions.run(compiled_regions.rms_norm, x_bsd, self.weight, self.eps)
        return recompute_cheap(self._normalize, x_bsd)

    def _normalize(self, x_bsd: torch.Tensor) -> torch.Tensor:
        return compiled_regions.rms_norm(x_bsd, self.weight, self.eps)
