"""Which backend can run which format on which GPU generation: the tables and the pure rules.

A plan that asks for a format the chosen backend cannot run is an error that
says why and how to get it, never a silent fallback (ARCHITECTURE.md).

Rules:
  * ``emulated`` runs every format on every device (the PyTorch quantizers).
  * ``torch`` runs every format on every device: FP8 formats as real scaled-mm GEMMs
    where this torch build and device run them (probed once per format, operand pair
    and device by ``backends/scaled_mm.py``; never on CPU, where it runs emulated),
    everything else emulated; the reason says which.
  * ``te`` (Transformer Engine) needs ``transformer_engine`` importable, CUDA,
    a CUDA device, and per format the compute capability of TE's recipe:

      bf16       >= 8.0 (Ampere)             TE modules with quantization disabled
      fp8        >= 8.9 (Ada / Hopper)       Float8CurrentScaling
      fp8_block  >= 9.0 (Hopper)             Float8BlockScaling (TE also wants CUDA >= 12.9)
      mxfp8      >= 10.0 (Blackwell)         MXFP8BlockScaling (block-scaled tensor cores)
      nvfp4      >= 10.0 (Blackwell)         NVFP4BlockScaling
      mxfp4      never: TE has no MXFP4 training recipe - emulated only
      fp4_block  never: TE has no E2M1 recipe with 1x128 / 128x128 FP32 scales - emulated only

    Recipe variants of the FP4 formats (``nvfp4-sr``, ``mxfp4+sr+rht``, ...) are emulated only:
    our TE backend runs TE's recipes as TE defines them.

    When TE is importable its own availability check (``te.is_*_available``)
    is consulted too (on the device, by ``backends/support.check``), so driver/cuBLAS
    limits surface with TE's reason.

This module probes nothing: ``check_gpu_type`` applies the rules to a GPU type from ``GPUS``
without one (the dry run, ``sizing/``), ``runs_native`` / ``gemm_time_costs`` price GEMMs on a
compute capability. ``precision/backends/support.py`` (``check``, ``require``) applies them to
this process's device at start-up, with the probes that need the backends' code (the scaled-mm
probe, TE's import and availability checks). Imports: ``formats``, ``gemm_shapes`` and
``scaled_mm_rules`` only, so every backend may import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_snip.precision.formats import FORMATS, get_format
from megatron_snip.precision.gemm_shapes import gemm_operands
from megatron_snip.precision.scaled_mm_rules import scaled_mm_expected_on, scaled_mm_shape_error

__all__ = [
    "ARCH_NAMES",
    "BACKENDS",
    "DATASHEET_TFLOPS",
    "EMULATED_GEMM_TIME_RATIO",
    "EMULATED_GEMM_TIME_RATIO_CPU",
    "GEMM_TIME_RATIO",
    "GPUS",
    "PEAK_BF16_TFLOPS",
    "TE_MIN_COMPUTE_CAPABILITY",
    "Capability",
    "GpuSpec",
    "arch_of",
    "check_gpu_type",
    "check_names",
    "gemm_time_costs",
    "peak_bf16_tflops",
    "runs_native",
]

BACKENDS: tuple[str, ...] = ("emulated", "torch", "te")
# Backends whose linear is ``gemm.quant_linear``: what it saves for backward is the input tensor
# itself, so under sequence parallelism the column-parallel linears can keep its sequence shard
# instead (parallel/sequence_shard.py), and on the reference path it takes the weight in the
# activation dtype, so a step's copy can be shared (precision/weight_copies.py). TE's modules save
# inside their own autograd functions and own their weight casts: they keep the gathered input.
QUANT_LINEAR_BACKENDS: tuple[str, ...] = ("emulated", "torch")

# Minimum CUDA compute capability of TE's recipe for each format; None: no TE recipe.
TE_MIN_COMPUTE_CAPABILITY: dict[str, tuple[int, int] | None] = {
    "bf16": (8, 0),
    "fp8": (8, 9),
    "fp8_block": (9, 0),
    "mxfp8": (10, 0),
    "nvfp4": (10, 0),
    "mxfp4": None,
    "fp4_block": None,
}
assert set(TE_MIN_COMPUTE_CAPABILITY) == set(FORMATS)

ARCH_NAMES = {(8, 0): "Ampere", (8, 9): "Ada", (9, 0): "Hopper", (10, 0): "Blackwell"}

# Dense BF16 tensor-core peak per device, TFLOP/s (NVIDIA datasheets, no sparsity): the MFU
# denominator. Matched as a substring of torch.cuda.get_device_name(), first match wins (so
# "H100 PCIe" before "H100"); logging.peak_tflops overrides it. MFU against the BF16 peak is the
# usual convention also for FP8/FP4 plans (it can then exceed what BF16 alone could reach).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense BF16 peak of a device named like ``torch.cuda.get_device_name()``; None if unknown."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key.lower() in device_name.lower()), None)


@dataclass(frozen=True)
class GpuSpec:
    """A GPU type: compute capability and device memory as nvidia-smi reports it (GiB)."""

    name: str
    sm: tuple[int, int]
    memory_gib: float


# The GPU types a config can be checked against without one (``--dry-run --gpu``), by lower-case name.
GPUS: dict[str, GpuSpec] = {
    g.name.lower(): g
    for g in (
        GpuSpec("A100", (8, 0), 80.0),
        GpuSpec("H100", (9, 0), 79.6),
        GpuSpec("H200", (9, 0), 140.4),
        GpuSpec("B200", (10, 0), 179.1),
        GpuSpec("GB200", (10, 0), 184.0),
    )
}


# --- GEMM time per format (issue #23: the efficiency target in GEMM time) ---------------------------
# Relative linear-GEMM time per FLOP against BF16 on each GPU generation's tensor cores, from the
# dense datasheet peaks (H100/H200: FP8 2x BF16; B200: FP8/MXFP8 2x, NVFP4/MXFP4 4x BF16). A format
# absent from a generation's row has no tensor-core path there.
GEMM_TIME_RATIO: dict[str, dict[str, float]] = {
    "Ampere": {"bf16": 1.0},
    "Ada": {"bf16": 1.0, "fp8": 0.5},
    "Hopper": {"bf16": 1.0, "fp8": 0.5, "fp8_block": 0.5},
    "Blackwell": {"bf16": 1.0, "fp8": 0.5, "fp8_block": 0.5, "mxfp8": 0.5, "nvfp4": 0.25, "mxfp4": 0.25},
}
# A GEMM the device and backend run *emulated* (quantize-dequantize, then a high-precision GEMM)
# costs more than BF16. On CUDA that GEMM is an fp32 matmul with TF32 off (the emulated formats'
# numerics: CUDA cores' FFMA, no tensor cores), so per FLOP it costs the datasheet ratio of the
# dense BF16 tensor-core peak to the FP32 (non-tensor) peak; the quantize-dequantize passes are
# memory-bound and small next to it. Dense peaks in TFLOPS, (BF16 tensor core, FP32):
#   Ampere    A100 SXM:           312 / 19.5  -> 16.0x   (NVIDIA A100 datasheet)
#   Ada       L40S:               362 / 91.6  ->  3.95x  (NVIDIA L40S datasheet; BF16 733 with sparsity)
#   Hopper    H100/H200 SXM:      989 / 67    -> 14.8x   (NVIDIA H100 datasheet: BF16 1979 with sparsity)
#   Blackwell HGX B200 (1000 W): 2250 / 80    -> 28.1x   (NVIDIA Blackwell datasheet: BF16 4.5 PF with sparsity)
# ``scripts/gpu_time_ratios.py`` measures the real figure on a device (``--formats`` with an
# emulated one) and prints it as ``snip.time_costs``, which replaces this table for a run and
# for the dry run. A GPU older than Ampere has no BF16 tensor cores to compare with: the Ampere
# figure stands in.
DATASHEET_TFLOPS: dict[str, tuple[float, float]] = {
    "Ampere": (312.0, 19.5),
    "Ada": (362.0, 91.6),
    "Hopper": (989.0, 67.0),
    "Blackwell": (2250.0, 80.0),
}
EMULATED_GEMM_TIME_RATIO: dict[str, float] = {arch: bf16 / fp32 for arch, (bf16, fp32) in DATASHEET_TFLOPS.items()}
# On CPU (the development machine) the emulated GEMM costs about 1.5x the unquantized one: the
# smallest ratio over the formats in docs/bench/emulated_gemm_ratio.txt (quant_linear
# forward+backward at a 1B-model layer, 1 thread; the command is in that file).
EMULATED_GEMM_TIME_RATIO_CPU = 1.5


def emulated_gemm_time_ratio(sm: tuple[int, int]) -> float:
    """GEMM time per FLOP of an emulated GEMM against BF16 on a GPU of compute capability ``sm``."""
    arch = arch_of(sm)
    return EMULATED_GEMM_TIME_RATIO.get(arch, EMULATED_GEMM_TIME_RATIO["Ampere"])


def arch_of(sm: tuple[int, int]) -> str:
    """The GPU generation of a compute capability: the newest ``ARCH_NAMES`` entry it reaches."""
    return ARCH_NAMES[max(cc for cc in ARCH_NAMES if sm >= cc)] if sm >= min(ARCH_NAMES) else "pre-Ampere"


# The CUDA version a GPU that is not here is assumed to run (the dry run, the time table): a current
# torch build, so every scaled-mm PyTorch documents for the GPU counts as available.
ASSUMED_CUDA = "12.9"


def runs_native(backend: str, fmt: str, sm: tuple[int, int]) -> bool:
    """Does ``backend`` run ``fmt``'s GEMMs on tensor cores (not emulated) on a GPU of compute capability
    ``sm``? The compute-capability rules of ``check_gpu_type`` (no probe of a real device)."""
    check_names(backend, fmt)
    if fmt == "bf16":
        return True
    if backend == "torch":
        native = scaled_mm_expected_on(fmt, sm, cuda=ASSUMED_CUDA)[0]
    elif backend == "te":
        need = TE_MIN_COMPUTE_CAPABILITY.get(fmt)
        native = need is not None and sm >= need
    else:
        native = False  # emulated
    return native and fmt in GEMM_TIME_RATIO.get(arch_of(sm), {})


def gemm_time_costs(backend: str, formats: Iterable[str], sm: tuple[int, int]) -> dict[str, float]:
    """Relative GEMM time per FLOP of each of ``formats`` (and ``"bf16"``, the reference 1.0) under
    ``backend`` on a GPU of compute capability ``sm``: the datasheet ratio where the format runs on
    tensor cores, ``emulated_gemm_time_ratio(sm)`` (> 1) where it runs emulated. Per format, for
    shapes the format's GEMMs accept (``gemm_runs_native`` prices one GEMM's shapes)."""
    def cost(f: str) -> float:
        if f == "bf16":
            return 1.0  # the reference, on every GPU
        return GEMM_TIME_RATIO[arch_of(sm)][f] if runs_native(backend, f, sm) else emulated_gemm_time_ratio(sm)

    return {f: cost(f) for f in dict.fromkeys(("bf16", *formats))}


def gemm_runs_native(backend: str, fmt: str, sm: tuple[int, int], gemm: str, n: int, k: int, tokens: int) -> bool:
    """``runs_native`` for one GEMM of a linear with TP-local weight (``n``, ``k``) on ``tokens``
    tokens: the torch backend also applies cuBLAS's scaled-mm shape rule to the GEMM's operands
    (``scaled_mm_shape_error``: a shape it refuses runs emulated, e.g. ``fp8_block`` with
    K/128 % 4 != 0), as ``ScaledMMGemm`` does at run time."""
    if not runs_native(backend, fmt, sm):
        return False
    if backend != "torch" or fmt == "bf16":
        return True
    (_, a_kind, a_shape), (_, b_kind, b_shape) = gemm_operands(gemm, n, k, tokens)
    return scaled_mm_shape_error(fmt, a_shape, a_kind, b_shape, b_kind, torch.device("cuda")) is None


def gemm_time_cost(backend: str, fmt: str, sm: tuple[int, int], gemm: str, n: int, k: int, tokens: int) -> float:
    """GEMM time per FLOP against BF16 of one GEMM (see ``gemm_runs_native``) in ``fmt``."""
    if fmt == "bf16":
        return 1.0
    if gemm_runs_native(backend, fmt, sm, gemm, n, k, tokens):
        return GEMM_TIME_RATIO[arch_of(sm)][fmt]
    return emulated_gemm_time_ratio(sm)


@dataclass(frozen=True)
class Capability:
    """Whether a backend can run a format here, and if not, why."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def check_names(backend: str, fmt: str) -> None:
    """ValueError unless ``backend`` is one of ``BACKENDS`` and ``fmt`` a format name (bad input)."""
    if backend not in BACKENDS:
        raise ValueError(f"precision.backend={backend!r} is not one of {BACKENDS}")
    get_format(fmt)  # ValueError naming the formats


def check_gpu_type(backend: str, fmt: str, gpu: GpuSpec) -> Capability:
    """Can ``backend`` run ``fmt`` on a ``gpu`` of this type? The compute-capability rules of
    ``backends/support.check`` for a GPU that is not here (no TE import, driver or TE verdict to consult).

    Raises ValueError for an unknown backend or format name.
    """
    check_names(backend, fmt)
    if backend == "emulated":
        return Capability(True, "emulated (reference quantize-dequantize, BF16/FP32 GEMMs: runs anywhere, no speed-up)")
    if backend == "torch":  # every format runs; the FP8 ones as real scaled-mm GEMMs where the GPU has them
        if fmt == "bf16":
            return Capability(True, "bf16 GEMMs run unquantized")
        real, why = scaled_mm_expected_on(fmt, gpu.sm, cuda=ASSUMED_CUDA)
        return Capability(True, f"torch scaled-mm on {gpu.name}" if real
                          else f"torch backend, emulated GEMM for this format ({why})")
    need = TE_MIN_COMPUTE_CAPABILITY.get(fmt)  # recipe variants are absent: no TE recipe either
    if need is None:
        return Capability(False, f"{fmt} has no Transformer Engine recipe; use precision.backend='emulated'")
    if gpu.sm >= need:
        return Capability(True, f"TE on {gpu.name} (sm_{gpu.sm[0]}{gpu.sm[1]})")
    return Capability(False, f"{fmt} needs {ARCH_NAMES.get(need, '')} (sm_{need[0]}{need[1]}+) under Transformer "
                             f"Engine; {gpu.name} is sm_{gpu.sm[0]}{gpu.sm[1]} - use a newer GPU or "
                             "precision.backend='emulated'")


