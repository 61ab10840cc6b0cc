"""Linear layers whose GEMMs run in plan-chosen precisions.

``PrecisionLinear`` is the seam between the model and the numerics: the model
builds one per (block, linear) and names it globally (``layer``, ``linear``);
``set_precision`` switches its three GEMMs (fprop, dgrad, wgrad) between steps
without rebuilding anything. Tensor-parallel subclasses (``parallel``) wrap the
local GEMM in communication through ``_input_comm`` / ``_output_comm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from megatron_snip.precision.gemm import quant_linear
from megatron_snip.precision.plan import GemmPrecision


class LinearProbe(Protocol):
    """Replaces a linear's local GEMM while SNIP statistics are collected (see snip/stats.py)."""

    def __call__(self, module: PrecisionLinear, x: torch.Tensor) -> torch.Tensor: ...


class PrecisionLinear(nn.Module):
    """y = x·Wᵀ with each GEMM in its own format.

    Shapes: x (..., in_features) -> y (..., out_features); ``weight`` is the fp32
    master weight (out_features, in_features) - the *local* shard under TP.

    Attributes set from outside between steps:
        precision: the GemmPrecision of this layer's fprop/dgrad/wgrad.
        generator: torch.Generator for stochastic rounding (shared by the model).
        amax_reduce: reduces a local amax over the TP group (None when unsharded).
        probe: a LinearProbe while SNIP statistics are being collected, else None.
    """

    def __init__(self, in_features: int, out_features: int, *, layer: int, linear: str, init_std: float) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.layer, self.linear = layer, linear
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.init_std = init_std
        self.precision = GemmPrecision()
        self.generator: torch.Generator | None = None
        self.amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.probe: LinearProbe | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def set_precision(self, precision: GemmPrecision) -> None:
        self.precision = precision

    def local_gemm(self, x: torch.Tensor, precision: GemmPrecision | None = None) -> torch.Tensor:
        """The quantized GEMM on the local shard, optionally in another precision (used by probes)."""
        return quant_linear(x, self.weight, precision or self.precision,
                            amax_reduce=self.amax_reduce, generator=self.generator)

    def _input_comm(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _output_comm(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._input_comm(x)
        y = self.probe(self, x) if self.probe is not None else self.local_gemm(x)
        return self._output_comm(y)

    def extra_repr(self) -> str:
        p = self.precision
        return (f"{self.in_features}->{self.out_features}, layer={self.layer}, linear={self.linear}, "
                f"precision=({p.fprop},{p.dgrad},{p.wgrad})")


def scaled_init_std(init_std: float, num_layers: int) -> float:
    """Output projections (proj, fc2) get std / sqrt(2·num_layers) (GPT-2 / Megatron)."""
    return init_std / math.sqrt(2.0 * num_layers)
