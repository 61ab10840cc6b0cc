"""What PyTorch's scaled-mm accepts, as pure rules: no device is touched and nothing is probed.

The one home of the scaled-mm rules that both the torch backend (``backends/scaled_mm.py``, which
runs and probes the GEMMs) and the capability table (``capability.py``: ``runs_native``, the dry
run's ``check_gpu_type``, the GEMM time costs) apply:

  * ``OPERAND_PAIRS``: the (a, b) operand kinds of a·bᵀ each GEMM of a linear presents;
  * ``scaled_mm_expected_on``: does PyTorch document a scaled-mm for a format on a GPU of a compute
    capability, with a torch built for a CUDA version (PyTorch's ScaledBlas.cpp checks);
  * ``scaled_mm_shape_error``: does cuBLAS's scaled-mm take a GEMM of these operand shapes
    (multiples of 16; ``fp8_block``'s 128x128 scale padding, ``needs_padded_scales``), given
    whether this torch has the padded-scale API (``padded_scale_api``: read from its signature).

Imports: ``formats`` and torch only (the bottom of ``precision``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megatron_snip.precision.formats import Operand, get_format

__all__ = ["OPERAND_PAIRS", "needs_padded_scales", "padded_scale_api", "scaled_mm_expected_on",
           "scaled_mm_shape_error"]

# The operand pairs (a, b) of a·bᵀ each GEMM presents (gemm.py): fprop X·Wᵀ, dgrad dY·(Wᵀ)ᵀ, wgrad dYᵀ·(Xᵀ)ᵀ.
OPERAND_PAIRS: tuple[tuple[Operand, Operand], ...] = (
    (Operand.ACTIVATION, Operand.WEIGHT),
    (Operand.GRADIENT, Operand.WEIGHT),
    (Operand.GRADIENT, Operand.ACTIVATION),
)


def padded_scale_api() -> tuple[bool, str]:
    """(available, why): does this torch have the scaled-mm entry point that takes padded 128x128 scales?

    Detected by signature, never by version string: ``torch.nn.functional.scaled_mm`` with
    per-operand scale recipes (``scale_recipe_a``/``scale_recipe_b``), ``output_dtype`` and
    ``use_fast_accum``, and ``ScalingType.BlockWise1x128``/``BlockWise128x128``. Its meta
    registration (``_check_sizes_v2`` in torch/_meta_registrations.py) and PyTorch's own
    test_scaled_mm_block_wise_numerics (K = 1280) take 128x128 scales as (L4, rows/128) with
    strides (1, L4), L4 = K/128 rounded up to a multiple of 4: cuBLAS's 16-byte padding."""
    fn, types = getattr(F, "scaled_mm", None), getattr(F, "ScalingType", None)
    if fn is None or types is None:
        return False, "this torch has no torch.nn.functional.scaled_mm (the scaled-mm API that takes padded scales)"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        return False, f"torch.nn.functional.scaled_mm has no readable signature ({e})"
    missing = [p for p in ("scale_recipe_a", "scale_recipe_b", "output_dtype", "use_fast_accum") if p not in params]
    missing += [t for t in ("BlockWise1x128", "BlockWise128x128") if not hasattr(types, t)]
    if missing:
        return False, f"torch.nn.functional.scaled_mm lacks {', '.join(missing)}"
    return True, "torch.nn.functional.scaled_mm takes padded 128x128 block scales"


def needs_padded_scales(fmt: str, a_shape: Sequence[int], a_kind: Operand, b_shape: Sequence[int],
                        b_kind: Operand) -> bool:
    """Does a·bᵀ have a 128x128-scaled operand of more than one block row with K/128 not a multiple of 4?
    Only such a GEMM needs cuBLAS's padded scale layout, which ``torch._scaled_mm`` cannot express."""
    if fmt != "fp8_block":
        return False
    spec, k = get_format(fmt), a_shape[1]
    return any(spec.block_for(kind)[0] > 1 and rows // 128 > 1 and (k // 128) % 4
               for rows, kind in ((a_shape[0], a_kind), (b_shape[0], b_kind)))


def scaled_mm_shape_error(fmt: str, a_shape: Sequence[int], a_kind: Operand, b_shape: Sequence[int], b_kind: Operand,
                          device: torch.device, *, padded_scales: bool | None = None) -> str | None:
    """Why cuBLAS's scaled-mm cannot take a·bᵀ for a (M, K), b (N, K) on ``device``; None if it can.

    On CUDA: K and N must be multiples of 16 (``_scaled_mm``'s checks). For ``fp8_block``, cuBLAS
    reads 128x128 block scales with their K/128 dim padded to a multiple of 4 (16 bytes: the
    cuBLAS docs; PyTorch's test_scaled_mm_block_wise_numerics pads it for ``_scaled_mm_v2``),
    while ``_scaled_mm``'s check accepts only the unpadded stride (K/128, 1): the two agree only
    when K/128 is a multiple of 4 (or there is one block row). Where this torch has the API that
    takes padded scales (``padded_scale_api``; ``padded_scales`` overrides the detection) such a
    GEMM runs through it (the 70B qkv dgrad at TP=8, K = 1280; the 7B fc1 dgrad at TP=4, K = 5504).
    """
    if torch.device(device).type != "cuda":
        return None
    (m, k), (n, _) = a_shape, b_shape
    if k % 16 or n % 16:
        return f"cuBLAS FP8 GEMMs need the reduction and output dims to be multiples of 16, got a {tuple(a_shape)} " \
               f"b {tuple(b_shape)}"
    if needs_padded_scales(fmt, a_shape, a_kind, b_shape, b_kind):
        padded, why = padded_scale_api() if padded_scales is None else (padded_scales, "padded_scales=False")
        if not padded:
            name, kind = ("a", a_kind) if get_format(fmt).block_for(a_kind)[0] > 1 and m // 128 > 1 else ("b", b_kind)
            return (f"fp8_block 128x128 block scales of {name} ({kind.value}) need K/128 to be a multiple of 4 "
                    f"(cuBLAS's 16-byte scale padding, which torch._scaled_mm cannot express; {why}), got K = {k}")
    return None


def scaled_mm_expected_on(fmt: str, sm: tuple[int, int], cuda: str | None) -> tuple[bool, str]:
    """Does PyTorch document a real scaled-mm for ``fmt`` on a GPU of compute capability ``sm`` with a torch
    built with CUDA ``cuda``? (expected, why); ``backends/scaled_mm.scaled_mm_expected`` asks it for a device.

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
