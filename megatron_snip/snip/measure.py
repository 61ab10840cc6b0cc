"""SNIP's measured errors: a linear's GEMMs in a candidate format, on stored operands.

What pass 1 of ``snip/stats.py`` runs per linear, probe micro-batch and format: the three GEMMs
(Y, dX, dW) quantized as the training GEMMs would be, and the quantization error of each operand,
with the layer's amax rule under ``precision.tp_amax``. Shapes: X (T, K), G = dL/dY (T, N), W (N, K).
"""

from __future__ import annotations

import torch

from megatron_snip.model.layers import PrecisionLinear
from megatron_snip.precision.formats import Operand, Scaling, get_format
from megatron_snip.precision.gemm import AmaxReducers, GemmAmaxReduce, operand_reducers, quant_linear
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize import quantize

# Element grids whose every value has at most BF16's 8 significant bits (E4M3: 4, E5M2: 3, E2M1: 2).
_BF16_SIGNIFICAND_BITS = 8


def bf16_exact(fmt: str) -> bool:
    """Whether ``fmt``'s dequantized operands are BF16 values exactly: power-of-two scales (no
    FP32 tensor or block scale) times an element of at most 8 significant bits. Their products
    are then exact in fp32 (8 + 8 <= 24 bits), so a BF16 GEMM accumulating in fp32 computes the
    fp32 GEMM of the same values, up to summation order. The one exception is underflow: a
    value below BF16's smallest subnormal, 2^-133 (an E4M3 subnormal in a block whose scale is
    below 2^-124), is fp32 but flushes in BF16 - a contribution under 2^-133 per product."""
    spec = get_format(fmt)
    if spec.scaling not in (Scaling.BLOCK_POW2, Scaling.BLOCK_E8M0):
        return False
    elements = [e for e in (spec.element, spec.grad_element) if e is not None]
    return all(e.mbits + 1 <= _BF16_SIGNIFICAND_BITS for e in elements)


def bf16_mm(qa: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
    """qa·qbᵀ of BF16-exact fp32 operands (M, R), (P, R) as one BF16 tensor-core GEMM with fp32
    output and accumulation (``torch.mm(..., out_dtype=torch.float32)``: CUDA and meta only), with
    cuBLAS's reduced-precision (BF16) split-K reductions off for the call."""
    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        return torch.mm(qa.to(torch.bfloat16), qb.to(torch.bfloat16).t(), out_dtype=torch.float32)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = reduced


def error_gemm(fmt: str, a: torch.Tensor, a_kind: Operand, b: torch.Tensor, b_kind: Operand, *,
               hadamard: bool, amax_reduce: GemmAmaxReduce, generator: torch.Generator | None,
               compiled: bool, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``GemmRunner`` of SNIP's measured errors: ``emulated_gemm``'s quantized operands (the
    same quantize calls in the same order, so the same stochastic-rounding draws); on CUDA, for a
    ``bf16_exact`` format, their product through ``bf16_mm`` (tensor cores instead of an fp32 GEMM
    without them: ~15x fewer cycles on H100) - elsewhere, and for the other formats, the fp32
    reference product; rounded to ``out_dtype`` once, as ``emulated_gemm``. On CPU the statistics
    are therefore the reference's, bit for bit."""
    reduce_a, reduce_b = operand_reducers(amax_reduce)
    qa = quantize(a, fmt, a_kind, generator=generator, hadamard=hadamard, amax_reduce=reduce_a, compiled=compiled)
    qb = quantize(b, fmt, b_kind, generator=generator, hadamard=hadamard, amax_reduce=reduce_b, compiled=compiled)
    if qa.device.type == "cuda" and bf16_exact(fmt):
        return bf16_mm(qa, qb).to(out_dtype)
    return (qa @ qb.t()).to(out_dtype)


def quantized_gemms(lin: PrecisionLinear, x_tk: torch.Tensor, g_tn: torch.Tensor, precision: GemmPrecision, *,
                    generator: torch.Generator | None = None,
                    compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Y, dX, dW) of the linear's three GEMMs in ``precision`` on stored X (T, K) and G (T, N).

    Run by the emulated formats (``quant_linear``, the numerics reference of every backend and
    the emulated backend's own GEMM) with the layer's TP amax reductions (``precision.tp_amax``:
    whole-tensor or per-shard amaxes, as the training GEMMs and the te backend), on a detached copy of
    W: Transformer Engine's module API could only run them through the training ``te.Linear``
    and its weight Parameter (``TEBackend.linear``). ``generator`` drives stochastic rounding.
    Each quantized GEMM is ``error_gemm`` (BF16 tensor cores on CUDA where that is exact).
    """
    with torch.enable_grad():
        x = x_tk.detach().requires_grad_(True)
        w = lin.weight.detach().float().requires_grad_(True)
        y = quant_linear(x, w, precision, amax_reduce=lin.amax_reduce, generator=generator, compiled=compiled,
                         gemm=error_gemm)
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
