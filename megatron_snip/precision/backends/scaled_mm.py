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
multiplies the elements exactly and accumulates them (FP8 tensor cores: ~14-bit partial sums,
promoted to fp32), then applies both decode scales, so its result is the exact product of the
emulated GEMM's operands within ``accumulation_tolerance`` (tests/unit/test_scaled_mm.py).
Scale layouts follow PyTorch's checks (``_mm``; tests/unit/test_scaled_mm_contract.py).

Which scalings a torch build runs is probed, not assumed: the first GEMM of each (format,
operand pair) on a device runs a 256x512x384 scaled-mm against the exact product of its
operands (``scaled_mm_support``); what fails or disagrees falls back with the reason.
``scaled_mm_expected`` says where PyTorch documents a scaled-mm, so that a device check can
tell a fallback there from an unsupported device. The pure rules applied here (operand pairs, the
shape rule, what each GPU generation runs) live in ``precision/scaled_mm_rules.py``. On CPU the
backend runs the emulated GEMM (``CPU_REASON``): CPU's scaled-mm is a slow reference, used by numerics tests only
(``cpu_reference=True``; torch 2.13 runs tensor-wise fp8 there and refuses block scales).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_snip.precision import fallbacks
from megatron_snip.precision.backends.base import Backend
from megatron_snip.precision.backends.weight_operands import WeightOperands, WeightSlot
from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.gemm import AmaxReducers, GemmAmaxReduce, emulated_gemm, operand_reducers, quant_linear
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize.scaled import SCALED_FORMATS, ScaledOperand, dequantize, quantize_scaled
from megatron_snip.precision.scaled_mm_rules import needs_padded_scales, scaled_mm_expected_on, scaled_mm_shape_error

__all__ = [
    "ACCUMULATION_BITS", "CPU_REASON", "GAUSSIAN_RHO", "SCALED_FORMATS", "ScaledMMGemm", "TorchBackend",
    "accumulation_tolerance", "fast_accum_for", "gemm_error", "magnitude_ratio", "scaled_mm_expected",
    "scaled_mm_support",
]

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return str(device)


def _scale_layout(op: ScaledOperand) -> torch.Tensor:
    """``op``'s decode scales laid out as PyTorch's checks want them for ``op.elements`` (R, C) as mat1.

    ``ScaledBlas.cpp`` (``is_blockwise_1x128_scaling`` / ``is_blockwise_128x128_scaling``):
      * 1x128 tiles: shape (R, C/128), outer-dim-major - strides (1, R);
      * 128x128 blocks: shape (R/128, C/128), row-major - strides (C/128, 1);
      * per tensor: the 0-d fp32 scale.
    A 1x128 operand has one row of scales per row (R/1 == R); a 128x128 one has R/128 < R.
    """
    s = op.scale
    if s.dim() == 0:
        return s
    if s.shape[0] == op.elements.shape[0]:  # 1 x 128 tiles
        return s.t().contiguous().t()
    return s.contiguous()  # 128 x 128 blocks


def fast_accum_for(fmt: str, a_kind: Operand, b_kind: Operand) -> bool:
    """Whether a GEMM runs with ``use_fast_accum=True`` (no promotion of the tensor cores' partial sums).

    As Transformer Engine: ``Float8CurrentScaling`` runs fprop (X·Wᵀ) with fast accumulation and
    dgrad/wgrad with split accumulation (the gradients' E5M2 products span more binades);
    ``Float8BlockScaling`` needs split accumulation for every GEMM (its per-128 block scales are
    applied to the partial sums), so ``fp8_block`` never uses it."""
    return fmt == "fp8" and (a_kind, b_kind) == (Operand.ACTIVATION, Operand.WEIGHT)


def _v2_scale(op: ScaledOperand) -> torch.Tensor:
    """``op``'s decode scales as ``F.scaled_mm`` takes them for ``op.elements`` (R, C), either operand:
    1x128 tiles (R, C/128) with strides (1, R); 128x128 blocks padded along C/128 to L4 (a multiple
    of 4, zeros: cuBLAS reads but never applies them) and viewed as (L4, R/128) with strides (1, L4)."""
    s = op.scale
    if s.shape[0] == op.elements.shape[0]:  # 1 x 128 tiles
        return s.t().contiguous().t()
    pad = -s.shape[1] % 4
    return F.pad(s, (0, pad)).t() if pad else s.contiguous().t()


def _v2_recipe(op: ScaledOperand):
    return F.ScalingType.BlockWise1x128 if op.scale.shape[0] == op.elements.shape[0] else F.ScalingType.BlockWise128x128


def _mm(a: ScaledOperand, b: ScaledOperand, *, out_dtype: torch.dtype = torch.float32,
        fast_accum: bool = False) -> torch.Tensor:
    """scaled-mm of a·bᵀ written in ``out_dtype``: mat1 = a row-major (M, K), mat2 = bᵀ column-major (K, N).

    ``out_dtype``: the epilogue applies both decode scales to the fp32 accumulator and rounds once
    to it - the activation dtype for fprop/dgrad (no fp32 M x N output and no separate cast), fp32
    for wgrad (fp32 main gradients). ``fast_accum``: ``fast_accum_for``.

    ``torch._scaled_mm``: PyTorch checks mat2's scales through their transpose against mat2ᵀ = b
    (``get_joint_scaling``: ``is_desired_scaling(b.t(), scale_b.t(), ...)``), so scale_b is b's own
    layout transposed: (K/128, N) for 1x128 tiles (contiguous), (K/128, N/128) with strides
    (1, K/128) for 128x128 blocks - the shapes torch's meta registration names ("scale_b should be
    (K/128, N)" / "(K/128, N/128)"). A 128x128 operand with K/128 not a multiple of 4 goes through
    ``F.scaled_mm`` with padded scales instead (``padded_scale_api``, ``_v2_scale``); callers check
    ``scaled_mm_shape_error`` first, which refuses such a GEMM where that API is absent.
    """
    if a.scale.dim() and needs_padded_scales("fp8_block", a.elements.shape, _kind_of(a), b.elements.shape, _kind_of(b)):
        # (a block-scaled a means fp8_block: the formats here scale both operands alike)
        return F.scaled_mm(a.elements, b.elements.t(), _v2_scale(a), _v2_recipe(a), _v2_scale(b), _v2_recipe(b),
                           output_dtype=out_dtype, use_fast_accum=fast_accum)
    return torch._scaled_mm(a.elements, b.elements.t(), _scale_layout(a), _scale_layout(b).t(),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


def _kind_of(op: ScaledOperand) -> Operand:
    """WEIGHT for 128x128 block scales, ACTIVATION for 1x128 tiles or a tensor scale (what ``needs_padded_scales`` asks)."""
    return Operand.WEIGHT if op.scale.dim() and op.scale.shape[0] != op.elements.shape[0] else Operand.ACTIVATION


# --- the probe's tolerance: what FP8 tensor cores' accumulation gives ---------------------------------
# Hopper's FP8 tensor cores keep about 14 significant bits in their accumulation (DeepSeek-V3,
# sec. 3.3.2, measured on H800), so each addition of a K-term dot product may be off by up to
# u = 2^-13 of the partial sum (truncation). Measured against the exact (fp64) product in units of
# |A|·|B|^T (``gemm_error``), independent of cancellation in the data:
#  * split accumulation (``use_fast_accum=False``: cuBLAS promotes the partial sums into fp32 at
#    short intervals): probabilistic rounding-error analysis (Higham & Mary, SIAM J. Sci. Comput.
#    2019) bounds a K-term sum by ~ sqrt(K) * u * sum|a_i b_i|: sqrt(K) * 2^-13;
#  * fast accumulation (``use_fast_accum=True``: no promotion, the whole K-term sum in the tensor
#    cores' accumulator): truncation errs one way, against the partial sum s_k, so the errors add
#    up instead of cancelling: |e| <= u * sum_k |s_k|. For independent zero-mean terms t of rms σ,
#    E|s_k| <= sqrt(k) σ, so E|e| <= u σ sum_{k<=K} sqrt(k) <= (2/3) u σ (K+1)^1.5, against the
#    product's magnitude K E|t|: (2/3) ρ sqrt(K) u (1 + 1/K)^1.5 with ρ = rms(t) / mean|t| of the
#    elementwise products (``magnitude_ratio``; π/2 for Gaussian operands, 2.8 for the probe's
#    operands with their per-block magnitudes). The bound takes every truncation at its largest
#    (u); the mean truncation is u/2, so a correct GEMM sits near half of it.
# fp32 accumulation (CPU, cuBLAS's promotions) is ~2^-24, far below either; a wrong scale layout or
# value is off by O(1) in some blocks and far above both. tests/unit/test_scaled_mm_contract.py
# checks both bounds on the probe with an emulated 14-bit truncating accumulator: K = 512, 9e-5
# (promotion every 128 terms) against 2.8e-3; 1.6e-3 - 2.6e-3 (no promotion) against the fast bound
# 5.3e-3; K = 1280 without promotion 4.2e-3 - 5.4e-3 against 8.2e-3 - where the split bound
# (4.4e-3) would have failed a correct fast-accumulating GEMM. Misplaced or doubled scales: 5e-2 - 6e-1.
ACCUMULATION_BITS = 14
GAUSSIAN_RHO = math.pi / 2  # rms / mean |t| of products of independent standard normals: 1 / (2/π)


def accumulation_tolerance(k: int, fast_accum: bool = False, rho: float = GAUSSIAN_RHO) -> float:
    """Largest ``gemm_error`` of a correct FP8 GEMM with reduction depth ``k`` (see the derivation above):
    sqrt(k) * 2^-(bits - 1) with split accumulation; with ``fast_accum`` the larger of that and
    (2/3) * rho * sqrt(k) * 2^-(bits - 1) * (1 + 1/k)^1.5, ``rho`` = ``magnitude_ratio`` of the operands."""
    u = 2.0 ** -(ACCUMULATION_BITS - 1)
    split = math.sqrt(k) * u
    if not fast_accum:
        return split
    return max(split, 2.0 / 3.0 * rho * math.sqrt(k) * u * (1.0 + 1.0 / k) ** 1.5)


def magnitude_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """ρ = rms / mean |t| over the elementwise products t = a[i, k] b[j, k] of a (M, K), b (N, K): the
    data's factor in the fast-accumulation bound (computed per k from row sums: no M x N x K tensor)."""
    a64, b64 = a.detach().double(), b.detach().double()
    square = ((a64 * a64).mean(0) * (b64 * b64).mean(0)).mean()
    mean_abs = (a64.abs().mean(0) * b64.abs().mean(0)).mean()
    return float(square.sqrt() / mean_abs) if mean_abs > 0 else GAUSSIAN_RHO


def gemm_error(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """The error of ``got`` ~ a·bᵀ (a (M, K), b (N, K)) against the exact (fp64) product, in units of
    the product of the magnitudes: the largest ||got - a·bᵀ|| / || |a|·|b|ᵀ || over the output's
    rows and columns (one wrong block scale of a or b spoils one row or column; a norm over the
    whole output would dilute it)."""
    a64, b64 = a.detach().double(), b.detach().double()
    diff = got.detach().double() - a64 @ b64.t()
    mag = a64.abs() @ b64.abs().t()
    return max((diff.norm(dim=1) / mag.norm(dim=1)).max().item(), (diff.norm(dim=0) / mag.norm(dim=0)).max().item())


# Probe shapes: real multiples of every block and of cuBLAS's 16 with K/128 = 4 (the 128x128 scales'
# padding needs none), and M != N != K, so a transposed scale tensor cannot pass for the right one.
# The padded-scale path is probed at K = 1280 (K/128 = 10, padded to 12), the 70B qkv dgrad's K at TP=8.
_PROBE_M, _PROBE_N, _PROBE_K = 256, 384, 512
_PROBE_K_PADDED = 1280


def _probe_operands(k: int = _PROBE_K) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, k), b (N, k) on the CPU with a random power-of-two magnitude in [1/4, 4] per (row,
    128-column block): neighbouring blocks get different scales, so a misplaced scale changes
    the product, and no block is so small that a wrong scale of it would go unseen."""
    gen = torch.Generator().manual_seed(0)

    def operand(rows: int) -> torch.Tensor:
        exps = torch.randint(-2, 3, (rows, k // 128), generator=gen).repeat_interleave(128, dim=1)
        return torch.randn(rows, k, generator=gen) * exps.float().exp2()

    return operand(_PROBE_M), operand(_PROBE_N)


def _probe(fmt: str, a_kind: Operand, b_kind: Operand, device: torch.device, *, fast_accum: bool = False,
           padded: bool = False) -> tuple[bool, str]:
    """Run one scaled-mm in ``fmt`` on ``device`` and compare it with the exact product of its operands.

    ``fast_accum``: with ``use_fast_accum=True`` and its bound; ``padded``: at K = 1280, through the
    padded-scale API (a GEMM only it can run)."""
    k = _PROBE_K_PADDED if padded else _PROBE_K
    a, b = (t.to(device) for t in _probe_operands(k))
    assert scaled_mm_shape_error(fmt, a.shape, a_kind, b.shape, b_kind, device) is None
    try:
        qa, qb = quantize_scaled(a, fmt, a_kind), quantize_scaled(b, fmt, b_kind)
        got = _mm(qa, qb, fast_accum=fast_accum)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:  # torch's refusal, whatever its type
        return False, f"torch._scaled_mm refused it: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    da, db = dequantize(qa), dequantize(qb)
    err = gemm_error(got, da, db)
    tol = accumulation_tolerance(k, fast_accum, magnitude_ratio(da, db) if fast_accum else GAUSSIAN_RHO)
    shape = f"{_PROBE_M}x{k}x{_PROBE_N}{' fast-accum' if fast_accum else ''}{' padded scales' if padded else ''}"
    if not err <= tol:  # NaN fails too
        return False, (f"torch._scaled_mm disagrees with the exact product of its operands ({shape} probe: error "
                       f"{err:.2e} > the {ACCUMULATION_BITS}-bit accumulation bound {tol:.2e})")
    return True, f"torch._scaled_mm on {device} ({shape} probe: error {err:.1e} <= bound {tol:.1e})"


# On CPU, torch._scaled_mm is a reference implementation: never faster than the emulated GEMM
# (measured here, torch 2.13, one thread: 0.1 s against 0.05 s for the fp32 matmul of a
# 1024x256x768 FP8 GEMM) and on some CPUs thousands of times slower (issue #22: 20.9 s against
# 5 ms). The torch backend therefore runs the emulated GEMM on CPU and says so at start-up; the
# CPU scaled-mm serves numerics tests only, which ask for it with ``cpu_reference=True``.
CPU_REASON = ("on CPU torch._scaled_mm is a reference implementation (never faster than the emulated GEMM, on some "
              "CPUs thousands of times slower), so the torch backend runs the emulated GEMM there - the same "
              "numerics up to fp32 summation order; real scaled-mm GEMMs need a CUDA GPU")

_SUPPORT: dict[tuple[str, str, str, str, bool, bool], tuple[bool, str]] = {}


def scaled_mm_support(fmt: str, device: torch.device | str, a_kind: Operand = Operand.ACTIVATION,
                      b_kind: Operand = Operand.WEIGHT, *, cpu_reference: bool = False,
                      padded: bool = False) -> tuple[bool, str]:
    """(ok, reason): does the torch backend run ``fmt``'s a·bᵀ as a real scaled-mm on ``device``?

    Probed once per (format, operand pair, device, fast accumulation, padded scales) and cached for
    the process; the pair decides fast accumulation (``fast_accum_for``), ``padded`` asks about the
    padded-scale API's GEMMs (``needs_padded_scales``). On CPU the answer is no (``CPU_REASON``,
    recorded as a fallback the first time it is asked, i.e. at start-up) unless ``cpu_reference``
    asks for the CPU reference scaled-mm (numerics tests).
    """
    device = torch.device(device)
    spec = get_format(fmt)
    if device.type == "cpu" and not cpu_reference:
        fallbacks.record("torch backend on cpu runs every GEMM emulated", CPU_REASON)
        return False, CPU_REASON
    if fmt not in SCALED_FORMATS:
        return False, (f"the torch backend has no scaled-mm path for {fmt} (its scaled-mm needs Blackwell's "
                       "swizzled block-scale layouts, not implemented); runs emulated")
    fast = fast_accum_for(spec.name, a_kind, b_kind)
    key = (spec.name, a_kind.value, b_kind.value, _device_key(device), fast, padded)
    if key not in _SUPPORT:  # probed even where scaled_mm_expected says no: a newer torch may run it
        _SUPPORT[key] = _probe(spec.name, a_kind, b_kind, device, fast_accum=fast, padded=padded)
    return _SUPPORT[key]


def scaled_mm_expected(fmt: str, device: torch.device | str) -> tuple[bool, str]:
    """(expected, why): does PyTorch document a real scaled-mm for ``fmt`` on this device?

    CPU: tensor-wise FP8 only (its reference kernel; the torch backend still runs emulated there
    unless ``cpu_reference``). CUDA: ``scaled_mm_expected_on`` for its compute capability and
    the CUDA version torch was built with. Where this says yes, a fallback is a failure of this
    code or of the build, not of the device (scripts/gpu_check.py fails on it).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return fmt == "fp8", "CPU torch._scaled_mm runs tensor-wise scaling only"
    if device.type != "cuda":
        return False, f"no scaled-mm on {device.type}"
    return scaled_mm_expected_on(fmt, torch.cuda.get_device_capability(device), torch.version.cuda)


class ScaledMMGemm:
    """``gemm.GemmRunner`` running each GEMM as a scaled-mm where supported, else emulated (recorded).

    Per GEMM: the output in ``out_dtype`` straight from the scaled-mm's epilogue, fast accumulation
    where ``fast_accum_for`` says, the weight operand from ``weight_slot`` (quantized once per step,
    ``weight_operands.py``) when one is given.

    Args:
        cpu_reference: run CPU GEMMs through CPU's reference scaled-mm too (numerics tests only:
            it is thousands of times slower than the emulated GEMM; see ``CPU_REASON``).
    Attributes:
        fallbacks: "<format> <a kind> x <b kind> on <device>" -> why that GEMM runs emulated.
    """

    def __init__(self, cpu_reference: bool = False) -> None:
        self.cpu_reference = cpu_reference
        self.fallbacks: dict[str, str] = {}

    def _fallback(self, fmt: str, a_kind: Operand, b_kind: Operand, device: torch.device, reason: str) -> None:
        key = f"{fmt} {a_kind.value} x {b_kind.value} on {_device_key(device)}"
        if key not in self.fallbacks:
            self.fallbacks[key] = reason
            fallbacks.record(f"torch backend {key} runs the emulated GEMM", reason)

    def __call__(self, fmt: str, a: torch.Tensor, a_kind: Operand, b: torch.Tensor, b_kind: Operand, *,
                 hadamard: bool, amax_reduce: GemmAmaxReduce, generator: torch.Generator | None,
                 compiled: bool, out_dtype: torch.dtype = torch.float32,
                 weight_slot: WeightSlot | None = None) -> torch.Tensor:
        ok, reason = scaled_mm_support(fmt, a.device, a_kind, b_kind, cpu_reference=self.cpu_reference)
        padded = False
        if ok:
            shape_error = scaled_mm_shape_error(fmt, a.shape, a_kind, b.shape, b_kind, a.device)
            ok, reason = shape_error is None, shape_error or reason
        if ok and needs_padded_scales(fmt, a.shape, a_kind, b.shape, b_kind):
            padded = True  # only the padded-scale API runs it: probed on its own
            ok, reason = scaled_mm_support(fmt, a.device, a_kind, b_kind, cpu_reference=self.cpu_reference,
                                           padded=True)
        if not ok:
            self._fallback(fmt + (" (padded scales)" if padded else ""), a_kind, b_kind, a.device, reason)
            return emulated_gemm(fmt, a, a_kind, b, b_kind, hadamard=hadamard, amax_reduce=amax_reduce,
                                 generator=generator, compiled=compiled, out_dtype=out_dtype)
        assert not hadamard and not get_format(fmt).stochastic_gradients  # SCALED_FORMATS have neither
        reduce_a, reduce_b = operand_reducers(amax_reduce)
        qa = quantize_scaled(a, fmt, a_kind, amax_reduce=reduce_a)
        make_b = functools.partial(quantize_scaled, b, fmt, b_kind, amax_reduce=reduce_b)
        qb = weight_slot.operand(b, fmt, make_b) if weight_slot is not None and b_kind is Operand.WEIGHT else make_b()
        try:
            return _mm(qa, qb, out_dtype=out_dtype, fast_accum=fast_accum_for(fmt, a_kind, b_kind))
        except (RuntimeError, ValueError) as e:  # a shape or layout this scaled-mm refuses (probe passed)
            self._fallback(fmt, a_kind, b_kind, a.device, f"torch._scaled_mm refused a {tuple(a.shape)} x "
                                                           f"{tuple(b.shape)} GEMM: {type(e).__name__}: {e}")
            # the emulated GEMM from the same operands (dequantize() is quantize()'s result bit for
            # bit), so amax_reduce's collective is not run twice
            return (dequantize(qa) @ dequantize(qb).t()).to(out_dtype)


class TorchBackend(Backend):
    """Real FP8 GEMMs through PyTorch's scaled-mm, per GEMM; every other format emulated (recorded).

    On CPU every GEMM runs emulated (``CPU_REASON``) unless ``cpu_reference`` is set. Each weight's
    scaled-mm operands are made once per step and reused by the step's micro-batches and by dgrad
    (``weights``, from ``linear``'s ``is_first_microbatch``; emptied by ``end_step``).

    Args:
        compiled: torch.compile the quantizers of the emulated fallbacks (same numerics).
        cpu_reference: use CPU's reference scaled-mm on CPU tensors (numerics tests only).
    """

    name = "torch"
    repeatable_backward = True  # the same autograd function as the emulated backend

    def __init__(self, compiled: bool = False, cpu_reference: bool = False) -> None:
        self.compiled = compiled
        self.gemm = ScaledMMGemm(cpu_reference=cpu_reference)
        self.weights = WeightOperands()

    @property
    def fallbacks(self) -> dict[str, str]:
        """Which (format, operand pair, device) GEMMs ran emulated so far, and why."""
        return self.gemm.fallbacks

    def end_step(self) -> None:
        """The step's scope closed (before the optimizer step): drop every cached weight operand."""
        self.weights.clear()

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
        slot = self.weights.slot(weight, is_first_microbatch)
        gemm = self.gemm if slot is None else functools.partial(self.gemm, weight_slot=slot)
        return quant_linear(x, weight, precision, amax_reduce=amax_reduce, generator=generator,
                            compiled=self.compiled, gemm=gemm)
