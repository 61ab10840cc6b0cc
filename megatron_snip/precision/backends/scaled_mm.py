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
tell a fallback there from an unsupported device. On CPU the backend runs the emulated GEMM
(``CPU_REASON``): CPU's scaled-mm is a slow reference, used by numerics tests only
(``cpu_reference=True``; torch 2.13 runs tensor-wise fp8 there and refuses block scales).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from megatron_snip.precision import fallbacks
from megatron_snip.precision.backends import Backend
from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.gemm import AmaxReducers, GemmAmaxReduce, emulated_gemm, operand_reducers, quant_linear
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize.scaled import SCALED_FORMATS, ScaledOperand, dequantize, quantize_scaled

__all__ = [
    "ACCUMULATION_BITS", "CPU_REASON", "SCALED_FORMATS", "ScaledMMGemm", "TorchBackend", "accumulation_tolerance",
    "gemm_error", "scaled_mm_expected", "scaled_mm_expected_on", "scaled_mm_shape_error", "scaled_mm_support",
]

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


def _mm(a: ScaledOperand, b: ScaledOperand) -> torch.Tensor:
    """scaled-mm of a·bᵀ with fp32 output: mat1 = a row-major (M, K), mat2 = bᵀ column-major (K, N).

    PyTorch checks mat2's scales through their transpose against mat2ᵀ = b (``get_joint_scaling``:
    ``is_desired_scaling(b.t(), scale_b.t(), ...)``), so scale_b is b's own layout transposed:
    (K/128, N) for 1x128 tiles (contiguous), (K/128, N/128) with strides (1, K/128) for 128x128
    blocks - the shapes torch's meta registration names ("scale_b should be (K/128, N)" /
    "(K/128, N/128)").
    """
    return torch._scaled_mm(a.elements, b.elements.t(), _scale_layout(a), _scale_layout(b).t(),
                            out_dtype=torch.float32)


def scaled_mm_shape_error(fmt: str, a_shape: Sequence[int], a_kind: Operand, b_shape: Sequence[int], b_kind: Operand,
                          device: torch.device) -> str | None:
    """Why cuBLAS's scaled-mm cannot take a·bᵀ for a (M, K), b (N, K) on ``device``; None if it can.

    On CUDA: K and N must be multiples of 16 (``_scaled_mm``'s checks). For ``fp8_block``, cuBLAS
    reads 128x128 block scales with their K/128 dim padded to a multiple of 4 (16 bytes: the
    cuBLAS docs; PyTorch's test_scaled_mm_block_wise_numerics pads it for ``_scaled_mm_v2``),
    while ``_scaled_mm``'s check accepts only the unpadded stride (K/128, 1): the two agree only
    when K/128 is a multiple of 4 (or there is one block row).
    """
    if torch.device(device).type != "cuda":
        return None
    (m, k), (n, _) = a_shape, b_shape
    if k % 16 or n % 16:
        return f"cuBLAS FP8 GEMMs need the reduction and output dims to be multiples of 16, got a {tuple(a_shape)} " \
               f"b {tuple(b_shape)}"
    if fmt == "fp8_block":
        spec = get_format(fmt)
        for name, rows, kind in (("a", m, a_kind), ("b", n, b_kind)):
            br, _ = spec.block_for(kind)
            if br > 1 and rows // br > 1 and (k // 128) % 4:
                return (f"fp8_block 128x128 block scales of {name} ({kind.value}) need K/128 to be a multiple of 4 "
                        f"(cuBLAS's 16-byte scale padding, which torch._scaled_mm cannot express), got K = {k}")
    return None


# --- the probe's tolerance: what FP8 tensor cores' accumulation gives ---------------------------------
# Hopper's FP8 tensor cores keep about 14 significant bits in their accumulation (DeepSeek-V3,
# sec. 3.3.2, measured on H800), so each addition of a K-term dot product may be off by up to
# 2^-13 of the partial sum (truncation). Probabilistic rounding-error analysis (Higham & Mary,
# SIAM J. Sci. Comput. 2019) bounds a K-term sum with unit roundoff u by ~ sqrt(K) * u * sum|a_i b_i|;
# measured against the exact (fp64) product in units of |A|·|B|^T (``gemm_error``), that is
# sqrt(K) * 2^-13 - independent of cancellation in the data. fp32 accumulation (CPU, cuBLAS's
# promotions to fp32) is ~2^-24 and far below it; a wrong scale layout or value is off by O(1)
# in some blocks and far above it. tests/unit/test_scaled_mm_contract.py checks both on the
# probe: an emulated 14-bit truncating accumulator gives 9e-5 with promotion every 128 terms and
# 1.6e-3 with none against the bound 2.8e-3 (K = 512); misplaced or doubled scales 5e-2 - 6e-1.
ACCUMULATION_BITS = 14


def accumulation_tolerance(k: int) -> float:
    """Largest ``gemm_error`` of a correct FP8 GEMM with reduction depth ``k``: sqrt(k) * 2^-(bits - 1)."""
    return math.sqrt(k) * 2.0 ** -(ACCUMULATION_BITS - 1)


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
_PROBE_M, _PROBE_N, _PROBE_K = 256, 384, 512


def _probe_operands() -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, K), b (N, K) on the CPU with a random power-of-two magnitude in [1/4, 4] per (row,
    128-column block): neighbouring blocks get different scales, so a misplaced scale changes
    the product, and no block is so small that a wrong scale of it would go unseen."""
    gen = torch.Generator().manual_seed(0)

    def operand(rows: int) -> torch.Tensor:
        exps = torch.randint(-2, 3, (rows, _PROBE_K // 128), generator=gen).repeat_interleave(128, dim=1)
        return torch.randn(rows, _PROBE_K, generator=gen) * exps.float().exp2()

    return operand(_PROBE_M), operand(_PROBE_N)


def _probe(fmt: str, a_kind: Operand, b_kind: Operand, device: torch.device) -> tuple[bool, str]:
    """Run one scaled-mm in ``fmt`` on ``device`` and compare it with the exact product of its operands."""
    a, b = (t.to(device) for t in _probe_operands())
    assert scaled_mm_shape_error(fmt, a.shape, a_kind, b.shape, b_kind, device) is None
    try:
        qa, qb = quantize_scaled(a, fmt, a_kind), quantize_scaled(b, fmt, b_kind)
        got = _mm(qa, qb)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:  # torch's refusal, whatever its type
        return False, f"torch._scaled_mm refused it: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    err, tol = gemm_error(got, dequantize(qa), dequantize(qb)), accumulation_tolerance(_PROBE_K)
    shape = f"{_PROBE_M}x{_PROBE_K}x{_PROBE_N}"
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

_SUPPORT: dict[tuple[str, str, str, str], tuple[bool, str]] = {}


def scaled_mm_support(fmt: str, device: torch.device | str, a_kind: Operand = Operand.ACTIVATION,
                      b_kind: Operand = Operand.WEIGHT, *, cpu_reference: bool = False) -> tuple[bool, str]:
    """(ok, reason): does the torch backend run ``fmt``'s a·bᵀ as a real scaled-mm on ``device``?

    Probed once per (format, operand pair, device) and cached for the process. On CPU the answer
    is no (``CPU_REASON``, recorded as a fallback the first time it is asked, i.e. at start-up)
    unless ``cpu_reference`` asks for the CPU reference scaled-mm (numerics tests).
    """
    device = torch.device(device)
    spec = get_format(fmt)
    if device.type == "cpu" and not cpu_reference:
        fallbacks.record("torch backend on cpu runs every GEMM emulated", CPU_REASON)
        return False, CPU_REASON
    if fmt not in SCALED_FORMATS:
        return False, (f"the torch backend has no scaled-mm path for {fmt} (its scaled-mm needs Blackwell's "
                       "swizzled block-scale layouts, not implemented); runs emulated")
    key = (spec.name, a_kind.value, b_kind.value, _device_key(device))
    if key not in _SUPPORT:  # probed even where scaled_mm_expected says no: a newer torch may run it
        _SUPPORT[key] = _probe(spec.name, a_kind, b_kind, device)
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


def scaled_mm_expected_on(fmt: str, sm: tuple[int, int], cuda: str | None) -> tuple[bool, str]:
    """``scaled_mm_expected`` for a GPU of compute capability ``sm`` and a torch built with CUDA ``cuda``.

    From PyTorch's own checks (ScaledBlas.cpp): FP8 scaled-mm needs sm_89 or sm_90+
    (``_scaled_mm_allowed_device``); the 1x128 / 128x128 block scalings ("DeepSeek style") run
    on sm_90 only (``_check_deepseek_support``) with cuBLAS >= 12.9.
    """
    name = f"sm_{sm[0]}{sm[1]}"
    if fmt == "fp8":
        return sm >= (8, 9), f"FP8 scaled-mm needs sm_89 or sm_90+; this GPU is {name}"
    if fmt != "fp8_block":
        return False, f"no scaled-mm path for {fmt} in the torch backend"
    if sm[0] != 9:
        return False, f"PyTorch runs fp8_block (1x128/128x128) scaled-mm on sm_90 only; this GPU is {name}"
    version = tuple(int(v) for v in (cuda or "0.0").split(".")[:2])
    return version >= (12, 9), f"fp8_block scaled-mm needs cuBLAS >= 12.9; torch is built with CUDA {cuda}"


class ScaledMMGemm:
    """``gemm.GemmRunner`` running each GEMM as a scaled-mm where supported, else emulated (recorded).

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
                 compiled: bool) -> torch.Tensor:
        ok, reason = scaled_mm_support(fmt, a.device, a_kind, b_kind, cpu_reference=self.cpu_reference)
        if ok:
            shape_error = scaled_mm_shape_error(fmt, a.shape, a_kind, b.shape, b_kind, a.device)
            ok, reason = shape_error is None, shape_error or reason
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

    On CPU every GEMM runs emulated (``CPU_REASON``) unless ``cpu_reference`` is set.

    Args:
        compiled: torch.compile the quantizers of the emulated fallbacks (same numerics).
        cpu_reference: use CPU's reference scaled-mm on CPU tensors (numerics tests only).
    """

    name = "torch"
    repeatable_backward = True  # the same autograd function as the emulated backend

    def __init__(self, compiled: bool = False, cpu_reference: bool = False) -> None:
        self.compiled = compiled
        self.gemm = ScaledMMGemm(cpu_reference=cpu_reference)

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
