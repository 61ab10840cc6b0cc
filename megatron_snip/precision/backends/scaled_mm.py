"""The torch backend: real low-precision GEMMs through PyTorch's scaled-mm, each GEMM in its own format.

``precision.backend = "torch"`` runs ``gemm.quant_linear`` (the same autograd function as
the emulated backend: same operands, same stochastic-rounding draws, same accumulation
rules) with ``ScaledMMGemm`` as its GEMM runner. Per GEMM (fprop, dgrad, wgrad of every
linear, each in the format its plan entry names):

  * ``fp8``: tensor-wise scales, E4M3 for activations and weights, E5M2 for gradients
    (fprop E4M3 x E4M3, dgrad and wgrad E5M2 x E4M3: the pairs cuBLAS supports);
  * ``fp8_block``: E4M3 with power-of-two block scales, 1x128 for activations and
    gradients, 128x128 for weights (DeepSeek-V3's layout, cuBLAS >= 12.9 on Hopper);
  * everything else (``mxfp8``, ``nvfp4``, ``mxfp4``; their scaled-mm needs Blackwell's
    swizzled scale layouts, which nothing here could validate) - and any GEMM whose
    scaled-mm this device's torch refuses - runs the emulated GEMM for that GEMM only.
    Each such fallback is recorded once per (format, operand pair, device) in
    ``ScaledMMGemm.fallbacks`` with its reason, warned about once and written to the run's
    text log (``precision/fallbacks.py``).

The quantized elements and scales are the reference quantizer's, bit for bit
(``quantize.scaled.quantize_scaled``: ``elements * scales == quantize(x)``); the GEMM
multiplies the elements exactly and accumulates in fp32, then applies both decode scales,
so its result is the emulated GEMM's up to fp32 accumulation order and the rounding of
the scale products (tests/unit/test_scaled_mm.py).

Which scalings a torch build runs is probed, not assumed: the first GEMM of each (format,
operand pair) on a device runs a small scaled-mm against the emulated product
(``scaled_mm_support``); what fails or disagrees falls back with the reason. Measured with
torch 2.13 on CPU: tensor-wise fp8 runs (bitwise equal to an fp32 matmul of the dequantized
operands for power-of-two scales); row-wise runs; 1x128/128x128 block scales, MX and NVFP4
are refused ("Invalid scaling configuration").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_snip.precision import fallbacks
from megatron_snip.precision.backends import Backend
from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.gemm import AmaxReducers, GemmAmaxReduce, emulated_gemm, operand_reducers, quant_linear
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize.scaled import SCALED_FORMATS, ScaledOperand, dequantize, quantize_scaled

__all__ = ["SCALED_FORMATS", "ScaledMMGemm", "TorchBackend", "scaled_mm_support"]

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]

# The operand pairs (a, b) of a·bᵀ each GEMM presents (gemm.py): fprop X·Wᵀ, dgrad dY·(Wᵀ)ᵀ, wgrad dYᵀ·(Xᵀ)ᵀ.
OPERAND_PAIRS: tuple[tuple[Operand, Operand], ...] = (
    (Operand.ACTIVATION, Operand.WEIGHT),
    (Operand.GRADIENT, Operand.WEIGHT),
    (Operand.GRADIENT, Operand.ACTIVATION),
)


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return str(device)


def _mm(a: ScaledOperand, b: ScaledOperand) -> torch.Tensor:
    """scaled-mm of a·bᵀ with fp32 output: mat1 row-major (M, R), mat2 column-major (R, P).

    Block decode scales of 1-row blocks are passed outer-dim-major (the layout cuBLAS's
    block-scaled GEMM reads); per-tensor scales are 0-d fp32.
    """
    def scale(op: ScaledOperand) -> torch.Tensor:
        s = op.scale
        if s.dim() == 2 and s.shape[0] == op.elements.shape[0]:  # 1 x bc blocks: one row of scales per row
            s = s.t().contiguous().t()
        return s

    return torch._scaled_mm(a.elements, b.elements.t(), scale(a), scale(b), out_dtype=torch.float32)


def _probe(fmt: str, a_kind: Operand, b_kind: Operand, device: torch.device) -> tuple[bool, str]:
    """Run one small scaled-mm in ``fmt`` on ``device`` and compare it with the emulated GEMM."""
    gen = torch.Generator().manual_seed(0)
    rows, cols = 128, 256  # multiples of every block (128x128 weights) and of cuBLAS's 16
    # Spread magnitudes over several binades so distinct blocks get distinct scales.
    a = (torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen).mul(8).exp2()).to(device)
    b = (torch.randn(rows, cols, generator=gen) * torch.rand(1, cols, generator=gen).mul(8).exp2()).to(device)
    try:
        got = _mm(quantize_scaled(a, fmt, a_kind), quantize_scaled(b, fmt, b_kind))
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:  # torch's refusal, whatever its type
        return False, f"torch._scaled_mm refused it: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    want = emulated_gemm(fmt, a, a_kind, b, b_kind, hadamard=False, amax_reduce=None, generator=None, compiled=False)
    err = ((got - want).norm() / want.norm()).item()
    if not err < 1e-5:  # fp32 accumulation order differs; a wrong scale layout is off by O(1)
        return False, f"torch._scaled_mm disagrees with the emulated GEMM (relative error {err:.2e})"
    return True, f"torch._scaled_mm on {device} (probe relative error vs emulated {err:.1e})"


_SUPPORT: dict[tuple[str, str, str, str], tuple[bool, str]] = {}


def scaled_mm_support(fmt: str, device: torch.device | str, a_kind: Operand = Operand.ACTIVATION,
                      b_kind: Operand = Operand.WEIGHT) -> tuple[bool, str]:
    """(ok, reason): does this torch run ``fmt``'s a·bᵀ as a real scaled-mm on ``device``?

    Probed once per (format, operand pair, device) and cached for the process.
    """
    device = torch.device(device)
    spec = get_format(fmt)
    if fmt not in SCALED_FORMATS:
        return False, (f"the torch backend has no scaled-mm path for {fmt} (its scaled-mm needs Blackwell's "
                       "swizzled block-scale layouts, not implemented); runs emulated")
    key = (fmt, a_kind.value, b_kind.value, _device_key(device))
    if key not in _SUPPORT:
        if device.type == "cuda" and spec.name == "fp8_block" and torch.cuda.get_device_capability(device) < (9, 0):
            _SUPPORT[key] = (False, f"fp8_block scaled-mm needs Hopper (sm_90) or newer; {device} is "
                                    f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")
        elif device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            _SUPPORT[key] = (False, f"FP8 scaled-mm needs Ada/Hopper (sm_89+); {device} is older")
        else:
            _SUPPORT[key] = _probe(fmt, a_kind, b_kind, device)
    return _SUPPORT[key]


class ScaledMMGemm:
    """``gemm.GemmRunner`` running each GEMM as a scaled-mm where supported, else emulated (recorded).

    Attributes:
        fallbacks: "<format> <a kind> x <b kind> on <device>" -> why that GEMM runs emulated.
    """

    def __init__(self) -> None:
        self.fallbacks: dict[str, str] = {}

    def _fallback(self, fmt: str, a_kind: Operand, b_kind: Operand, device: torch.device, reason: str) -> None:
        key = f"{fmt} {a_kind.value} x {b_kind.value} on {_device_key(device)}"
        if key not in self.fallbacks:
            self.fallbacks[key] = reason
            fallbacks.record(f"torch backend {key} runs the emulated GEMM", reason)

    def __call__(self, fmt: str, a: torch.Tensor, a_kind: Operand, b: torch.Tensor, b_kind: Operand, *,
                 hadamard: bool, amax_reduce: GemmAmaxReduce, generator: torch.Generator | None,
                 compiled: bool) -> torch.Tensor:
        ok, reason = scaled_mm_support(fmt, a.device, a_kind, b_kind)
        if ok and a.device.type == "cuda" and (a.shape[1] % 16 or b.shape[0] % 16):
            ok, reason = False, f"cuBLAS FP8 GEMMs need the reduction and output dims to be multiples of 16, got " \
                                f"a {tuple(a.shape)} b {tuple(b.shape)}"
        if not ok:
            self._fallback(fmt, a_kind, b_kind, a.device, reason)
            return emulated_gemm(fmt, a, a_kind, b, b_kind, hadamard=hadamard, amax_reduce=amax_reduce,
                                 generator=generator, compiled=compiled)
        assert not hadamard and not get_format(fmt).stochastic_gradients  # SCALED_FORMATS have neither
        reduce_a, reduce_b = operand_reducers(amax_reduce)
        qa = quantize_scaled(a, fmt, a_kind, amax_reduce=reduce_a)
        qb = quantize_scaled(b, fmt, b_kind, amax_reduce=reduce_b)
        try:
            return _mm(qa, qb)
        except (RuntimeError, ValueError) as e:  # a shape or layout this scaled-mm refuses (probe passed)
            self._fallback(fmt, a_kind, b_kind, a.device, f"torch._scaled_mm refused a {tuple(a.shape)} x "
                                                           f"{tuple(b.shape)} GEMM: {type(e).__name__}: {e}")
            # the emulated GEMM from the same operands (dequantize() is quantize()'s result bit for
            # bit), so amax_reduce's collective is not run twice
            return dequantize(qa) @ dequantize(qb).t()


class TorchBackend(Backend):
    """Real FP8 GEMMs through PyTorch's scaled-mm, per GEMM; every other format emulated (recorded).

    Args:
        compiled: torch.compile the quantizers of the emulated fallbacks (same numerics).
    """

    name = "torch"
    repeatable_backward = True  # the same autograd function as the emulated backend

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled
        self.gemm = ScaledMMGemm()

    @property
    def fallbacks(self) -> dict[str, str]:
        """Which (format, operand pair, device) GEMMs ran emulated so far, and why."""
        return self.gemm.fallbacks

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        precision: GemmPrecision,
        *,
        amax_reduce: AmaxReducers | AmaxReduce | None = None,
        generator: torch.Generator | None = None,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        return quant_linear(x, weight, precision, amax_reduce=amax_reduce, generator=generator,
                            compiled=self.compiled, gemm=self.gemm)
