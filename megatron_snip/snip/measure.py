"""SNIP's measured errors: a linear's GEMMs in a candidate format, on stored operands.

What pass 1 of ``snip/stats.py`` runs per linear, probe micro-batch and format: the three GEMMs
(Y, dX, dW) quantized as the training GEMMs would be, and the quantization error of each operand,
with the layer's amax rule under ``precision.tp_amax``. Shapes: X (T, K), G = dL/dY (T, N), W (N, K).
"""

from __future__ import annotations

import torch

from megatron_snip.model.layers import PrecisionLinear
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.gemm import AmaxReducers, quant_linear
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize import quantize


def quantized_gemms(lin: PrecisionLinear, x_tk: torch.Tensor, g_tn: torch.Tensor, precision: GemmPrecision, *,
                    generator: torch.Generator | None = None,
                    compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Y, dX, dW) of the linear's three GEMMs in ``precision`` on stored X (T, K) and G (T, N).

    Run by the emulated formats (``quant_linear``, the numerics reference of every backend and
    the emulated backend's own GEMM) with the layer's TP amax reductions (``precision.tp_amax``:
    whole-tensor or per-shard amaxes, as the training GEMMs and the te backend), on a detached copy of
    W: Transformer Engine's module API could only run them through the training ``te.Linear``
    and its weight Parameter (``TEBackend.linear``). ``generator`` drives stochastic rounding.
    """
    with torch.enable_grad():
        x = x_tk.detach().requires_grad_(True)
        w = lin.weight.detach().float().requires_grad_(True)
        y = quant_linear(x, w, precision, amax_reduce=lin.amax_reduce, generator=generator, compiled=compiled)
        dx, dw = torch.autograd.grad(y, (x, w), g_tn)
    return y.detach().float(), dx.float(), dw.float()


def weight_error(lin: PrecisionLinear, fmt: str, *, generator: torch.Generator | None = None,
                 compiled: bool = False) -> torch.Tensor:
    """Q(W) - W of the linear's weight (N, K) fp32 as its fprop quantizes it (blocked along K)."""
    w = lin.weight.detach().float()
    if fmt == "bf16":
        return torch.zeros_like(w)
    reduce = AmaxReducers.of(lin.amax_reduce).w  # the weight's rule under precision.tp_amax, as quant_linear's
    return quantize(w, fmt, Operand.WEIGHT, generator=generator, amax_reduce=reduce, compiled=compiled) - w


def operand_error(lin: PrecisionLinear, x_tk: torch.Tensor, w_nk: torch.Tensor, fmt: str, which: str, *,
                  generator: torch.Generator | None = None, compiled: bool = False) -> float:
    """‖Q(a) - a‖² of one operand as its GEMM quantizes it (x, w: fprop blocking along K; g: dgrad along N),
    with the layer's amax reduction for that operand (``precision.tp_amax``, as ``quant_linear``);
    read on the host (``operand_error_t`` keeps it on the device)."""
    if fmt == "bf16":
        return 0.0
    return float(operand_error_t(lin, x_tk, w_nk, fmt, which, generator=generator, compiled=compiled))


def operand_error_t(lin: PrecisionLinear, x_tk: torch.Tensor, w_nk: torch.Tensor, fmt: str, which: str, *,
                    generator: torch.Generator | None = None, compiled: bool = False) -> torch.Tensor:
    """``operand_error`` as a 0-d fp32 tensor on the operand's device (no host read); ``fmt`` not bf16."""
    red = AmaxReducers.of(lin.amax_reduce)
    a, op, reduce = {"x": (x_tk, Operand.ACTIVATION, red.x), "w": (w_nk, Operand.WEIGHT, red.w),
                     "g": (x_tk, Operand.GRADIENT, red.dy)}[which]
    q = quantize(a, fmt, op, generator=generator, amax_reduce=reduce, compiled=compiled)
    return (q - a).pow(2).sum()
