"""quant_linear: a linear layer's Y = X·Wᵀ whose three GEMMs each run in a plan-chosen format.

For Y = X·Wᵀ with X (T, K) (leading dims of x flattened into T) and W (N, K):

    fprop  Y  = Q(X) · Q(W)ᵀ            X and W blocked along K
    dgrad  dX = Q(dY) · Q(Wᵀ)ᵀ          dY and Wᵀ (K, N) blocked along N
    wgrad  dW = Q(dYᵀ) · Q(Xᵀ)ᵀ         dYᵀ (N, T) and Xᵀ (K, T) blocked along T;
                                        nvfp4 rotates both by the 16-point RHT

Each GEMM uses its own format (``GemmPrecision.fprop/.dgrad/.wgrad``); Q is
``quantize.quantize`` with the operand kind that picks element type, blocking
and stochastic rounding (ACTIVATION X, WEIGHT W, GRADIENT dY).

Arithmetic (decided in the autograd function, whatever the caller's autocast
state): a quantized GEMM multiplies the dequantized operands as fp32 and
accumulates in fp32 (or, in the torch backend, a scaled-mm of the quantized
elements with fp32 accumulation), then rounds once to the output dtype (the
GEMM runner's ``out_dtype``: a scaled-mm writes it from its epilogue). A ``"bf16"``
GEMM is the unquantized reference: it multiplies the raw operands in the
activation dtype - autocast's when autocast is on for x's device, else x's
(fp32 x: fp32, exact F.linear; bf16 x or bf16 autocast: a bf16 matmul, as
F.linear would - the one place bf16 arithmetic is used). Y is returned in the
activation dtype, dX in x's dtype, dW in the weight's.

Memory: backward saves only x and the weight (the same tensors F.linear saves)
and re-quantizes them; the emulated backend keeps no quantized copy across calls (the
torch backend keeps each weight's float8 operands for the step, 1-2 bytes per weight
element: ``backends/weight_operands.py``). x is saved as given:
under bf16 autocast the model feeds bf16 (residual stream and norm outputs run in it), so a
quantized linear saves 2 bytes per input element, as a BF16 one does. Saving Q(X) instead
would not help here: wgrad quantizes X along T (nvfp4: after the RHT), not along K as fprop
does, so fprop's Q(X) cannot serve it, and these quantizers return dequantized fp32 values -
a kept Q(X) would cost 4 bytes per element. A packed copy (FP4 codes + scales, ~0.56 B per
element, what TE keeps) is a real backend's job. Re-quantizing
W for dgrad reads W once in the emulated backend (the torch backend transposes fprop's
float8 codes instead, once per step). For nvfp4's symmetric 16x16 weight blocks Q(Wᵀ) == Q(W)ᵀ,
so fprop's Q(W) could be saved for dgrad instead; we do not: it would save ~4% of
the quantizer work of a step (W is small next to X and dY) at the price of an fp32
weight copy per linear and micro-batch in flight.

Randomness: only gradient operands of formats with stochastic rounding (nvfp4)
draw from ``generator``: dgrad's Q(dY) first, then wgrad's Q(dYᵀ), one draw of
two seeds each.

Tensor scales under tensor parallelism (no torch.distributed here): formats with a tensor
scale (fp8, nvfp4) scale an operand by its amax. The caller says per operand - X, W, dY:
``AmaxReducers`` - which amax that is: the local one (None: the operand is replicated over TP,
or each shard scales by its own, ``precision.tp_amax="shard"``) or the local one reduced by a
callable (an all-reduce MAX over the TP group: the whole tensor's, ``"tensor"``). Each reduced
amax is computed once per forward/backward of a micro-batch: fprop's W amax serves dgrad's Wᵀ,
dgrad's dY amax serves wgrad's dYᵀ and fprop's X amax wgrad's Xᵀ unless wgrad rotates them (the
nvfp4 RHT changes the amax) - an amax is a property of the tensor, whatever the format or
layout, so the bits are those of one reduction per operand and GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.profile_labels import label
from megatron_snip.precision.quantize import quantize

__all__ = ["TP_AMAX_MODES", "AmaxReducers", "GemmRunner", "activation_dtype", "emulated_gemm", "operand_reducers",
           "quant_linear", "tune_cpu_malloc"]

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]
# A GEMM's reducers: one callable (or None) for both operands, or an (a's, b's) pair.
GemmAmaxReduce = AmaxReduce | None | tuple[AmaxReduce | None, AmaxReduce | None]

# precision.tp_amax: "tensor" = shards scale by the whole tensor's amax (reduced over TP where an
# operand is sharded); "shard" = each TP shard by its own amax, as Transformer Engine does.
TP_AMAX_MODES: tuple[str, ...] = ("tensor", "shard")


@dataclass(frozen=True)
class AmaxReducers:
    """The amax reduction of each operand of one linear (used by formats with a tensor scale).

    x: the input X (fprop's X, wgrad's Xᵀ); w: the weight W (fprop's W, dgrad's Wᵀ); dy: the
    output gradient (dgrad's dY, wgrad's dYᵀ). Each is a callable applied to the operand's local
    0-d amax (e.g. an all-reduce MAX over the TP group) or None: the local amax is used.
    """

    x: AmaxReduce | None = None
    w: AmaxReduce | None = None
    dy: AmaxReduce | None = None

    @staticmethod
    def of(amax_reduce: AmaxReducers | AmaxReduce | None) -> AmaxReducers:
        """``amax_reduce`` as AmaxReducers: a single callable (or None) applies to every operand."""
        if isinstance(amax_reduce, AmaxReducers):
            return amax_reduce
        return AmaxReducers(amax_reduce, amax_reduce, amax_reduce)

    @property
    def reduces(self) -> bool:
        """Whether any operand's amax is reduced (False: every shard scales by its local amax)."""
        return any(r is not None for r in (self.x, self.w, self.dy))


def operand_reducers(amax_reduce: GemmAmaxReduce) -> tuple[AmaxReduce | None, AmaxReduce | None]:
    """A ``GemmRunner``'s ``amax_reduce`` as the (a's, b's) pair."""
    if isinstance(amax_reduce, tuple):
        return amax_reduce
    return amax_reduce, amax_reduce


class _ReducedOnce:
    """An AmaxReduce that runs its reduction on the first call and returns that result after.

    One per (operand, rotation) and micro-batch (``_QuantLinearFn``): the GEMMs that quantize the
    same tensor share one collective. Valid because every call passes the same local amax (the
    same tensor, unmodified between forward and backward)."""

    def __init__(self, reduce: AmaxReduce) -> None:
        self.reduce, self.result = reduce, None

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        if self.result is None:
            self.result = self.reduce(amax)
        return self.result


def _once(reduce: AmaxReduce | None) -> AmaxReduce | None:
    return None if reduce is None else _ReducedOnce(reduce)


def tune_cpu_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Stop glibc malloc from re-faulting the emulated GEMMs' temporaries; call once per process.

    Why: every quantized GEMM allocates and frees operand-sized fp32 temporaries (up to
    T x N, ~12 MiB for tiny's fc1). glibc maps blocks above its mmap threshold afresh
    each time and returns the free top of its heap to the OS once it exceeds its trim
    threshold (both dynamic, starting at 128 KiB / 256 KiB), so the next temporary
    page-faults in again: 5-40k faults per tiny nvfp4 step, ~5% of a compiled step and
    a third of an eager one (python -m experiments.bench.step). Fixing the thresholds - blocks up
    to ``mmap_threshold`` (glibc's cap is 32 MiB) come from the heap, and up to
    ``trim_threshold`` bytes of free heap stay mapped - removes them. The same effect
    as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ in the environment, or LD_PRELOAD
    of jemalloc/tcmalloc, which PyTorch's CPU tuning guide recommends.

    Process-wide, so the entry point decides (the library never calls it). Returns
    False where the C library has no ``mallopt`` (not glibc): nothing changed.
    """
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, mmap_threshold)) and bool(mallopt(m_trim_threshold, trim_threshold))


class GemmRunner(Protocol):
    """Computes one quantized GEMM a·bᵀ of a linear, both operands with their reduction dim last.

    a (M, R) and b (P, R), either possibly a transposed view; returns (M, P) in ``out_dtype``,
    accumulated in fp32 and rounded to ``out_dtype`` once (the activation dtype for fprop, x's for
    dgrad, the weight's for wgrad: a real GEMM writes it from its epilogue, with no fp32 M x P
    tensor in between). The autograd function calls it with autocast disabled, so what it returns
    is what it computed. ``amax_reduce``: one reducer for both operands or an (a's, b's) pair
    (``operand_reducers``).
    """

    def __call__(self, fmt: str, a: torch.Tensor, a_kind: Operand, b: torch.Tensor, b_kind: Operand, *,
                 hadamard: bool, amax_reduce: GemmAmaxReduce, generator: torch.Generator | None,
                 compiled: bool, out_dtype: torch.dtype) -> torch.Tensor: ...


def emulated_gemm(fmt: str, a: torch.Tensor, a_kind: Operand, b: torch.Tensor, b_kind: Operand, *,
                  hadamard: bool, amax_reduce: GemmAmaxReduce, generator: torch.Generator | None,
                  compiled: bool, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference ``GemmRunner``: Q(a)·Q(b)ᵀ on the dequantized operands, fp32 multiply and accumulate,
    then rounded to ``out_dtype``.

    Q(a) is quantized before Q(b), so stochastic rounding draws from ``generator`` in that order.
    """
    reduce_a, reduce_b = operand_reducers(amax_reduce)
    qa = quantize(a, fmt, a_kind, generator=generator, hadamard=hadamard, amax_reduce=reduce_a, compiled=compiled)
    qb = quantize(b, fmt, b_kind, generator=generator, hadamard=hadamard, amax_reduce=reduce_b, compiled=compiled)
    return (qa @ qb.t()).to(out_dtype)


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear computes its activations in: autocast's for x's device when enabled, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _QuantLinearFn(torch.autograd.Function):
    """Autograd function behind ``quant_linear``; see the module docstring for the math.

    Accumulation precision is decided here, not by the caller's autocast state: the forward
    records the activation dtype (``activation_dtype``: autocast's if on, else x's) and every
    GEMM then runs with autocast disabled - quantized GEMMs in fp32 (as SNIP's error
    measurements assume), "bf16" GEMMs on operands cast to the activation dtype, in forward and
    backward alike (the same GEMMs F.linear would run under that autocast). Y comes back in the
    activation dtype, dX in x's dtype, dW in the weight's.
    """

    @staticmethod
    def forward(ctx, x, weight, precision, reducers, generator, compiled, gemm):  # type: ignore[override]
        act = activation_dtype(x)
        x_tk = x.reshape(-1, x.shape[-1])
        # One reduction per operand and micro-batch (module docstring): fprop's amaxes of X and W
        # are kept for wgrad's unrotated Xᵀ and dgrad's Wᵀ.
        x_amax, w_amax = _once(reducers.x), _once(reducers.w)
        with torch.autocast(x.device.type, enabled=False), label("gemm", "fprop", precision.fprop):
            if precision.fprop == "bf16":
                y_tn = F.linear(x_tk.to(act), weight.to(act))
            else:
                y_tn = gemm(precision.fprop, x_tk, Operand.ACTIVATION, weight, Operand.WEIGHT, hadamard=False,
                            amax_reduce=(x_amax, w_amax), generator=None, compiled=compiled, out_dtype=act)
        ctx.save_for_backward(x, weight)
        ctx.precision, ctx.generator, ctx.compiled = precision, generator, compiled
        ctx.reducers, ctx.x_amax, ctx.w_amax = reducers, x_amax, w_amax
        ctx.gemm, ctx.act = gemm, act
        return y_tn.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        precision: GemmPrecision = ctx.precision
        act: torch.dtype = ctx.act
        x_tk = x.reshape(-1, x.shape[-1])
        dy_tn = dy.reshape(-1, dy.shape[-1])
        common = {"generator": ctx.generator, "compiled": ctx.compiled}
        reducers: AmaxReducers = ctx.reducers
        dy_amax = _once(reducers.dy)  # dgrad's dY amax, kept for wgrad's unrotated dYᵀ
        dx = dw = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                with label("gemm", "dgrad", precision.dgrad):
                    if precision.dgrad == "bf16":
                        dx_tk = dy_tn.to(act) @ weight.to(act)
                    else:
                        # Wᵀ is a transposed view: quantize reads W contiguously, blocks along N.
                        dx_tk = ctx.gemm(precision.dgrad, dy_tn, Operand.GRADIENT, weight.t(), Operand.WEIGHT,
                                         hadamard=False, amax_reduce=(dy_amax, ctx.w_amax), out_dtype=x.dtype, **common)
                    dx = dx_tk.to(x.dtype).reshape(x.shape)
            if ctx.needs_input_grad[1]:
                with label("gemm", "wgrad", precision.wgrad):
                    if precision.wgrad == "bf16":
                        dw = dy_tn.to(act).t() @ x_tk.to(act)
                    else:
                        rht = get_format(precision.wgrad).wgrad_hadamard
                        # The RHT changes the operands' amaxes: rotated ones are reduced afresh.
                        reduce_pair = (reducers.dy, reducers.x) if rht else (dy_amax, ctx.x_amax)
                        dw = ctx.gemm(precision.wgrad, dy_tn.t(), Operand.GRADIENT, x_tk.t(), Operand.ACTIVATION,
                                      hadamard=rht, amax_reduce=reduce_pair, out_dtype=weight.dtype,
                                      **common)
                    dw = dw.to(weight.dtype)
        return dx, dw, None, None, None, None, None


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: GemmPrecision,
    *,
    amax_reduce: AmaxReducers | AmaxReduce | None = None,
    generator: torch.Generator | None = None,
    compiled: bool = False,
    gemm: GemmRunner = emulated_gemm,
) -> torch.Tensor:
    """Y = X·Wᵀ whose fprop, dgrad and wgrad GEMMs run in ``precision``'s formats.

    Args:
        x: (..., K) activations, fp32 or bf16; leading dims are tokens (T).
        weight: (N, K) weight, normally the fp32 master Parameter.
        precision: formats of the three GEMMs (``"bf16"`` = unquantized).
        amax_reduce: per operand (``AmaxReducers``), or one callable for every
            operand: applied to the local tensor amax of formats with a tensor
            scale (an all-reduce MAX over the TP group), once per operand and
            micro-batch (see the module docstring); None = local amaxes.
        generator: stochastic-rounding randomness for the backward pass.
        compiled: run the quantizers through torch.compile (same numerics,
            much faster on CPU after the first call per shape).
        gemm: runs each quantized GEMM (default: the emulated reference; the
            torch backend passes its scaled-mm runner).
    Returns:
        (..., N) in the activation dtype (autocast's when enabled, else x's).
    Raises:
        ValueError: mismatched shapes. Block divisibility is not checked here:
            a plan's formats are checked against every linear's shapes once, when
            it is applied (``precision/gemm_shapes.py``); called directly with a
            misfit, the quantizer of the first GEMM that does not fit raises.
    """
    if not isinstance(precision, GemmPrecision):
        raise TypeError(f"quant_linear: precision must be a GemmPrecision, got {type(precision).__name__}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"quant_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
            "(need x (..., K) and weight (N, K))"
        )
    if precision.is_reference:
        return F.linear(x, weight.to(x.dtype))  # the reference path, autograd as usual
    return _QuantLinearFn.apply(x, weight, precision, AmaxReducers.of(amax_reduce), generator, compiled, gemm)
