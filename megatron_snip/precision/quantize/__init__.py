"""Reference quantize-dequantize (QDQ) functions for every format in ``formats.py``.

Everything here is a pure PyTorch function of its inputs: fp32 in, fp32 out,
vectorized over blocks (no Python loops over blocks), deterministic given a
``torch.Generator``. These functions are the specification that kernels and
backends are tested against (ARCHITECTURE.md, "Numerics conventions").

Files (one job each):
  * ``bits.py`` - exact power-of-two helpers by fp32 bit manipulation;
  * ``rounding.py`` - element rounding: ``round_e4m3``, ``round_e5m2``,
    ``round_e2m1`` (RNE, or stochastic given uniform noise; saturating) and
    ``round_e8m0``;
  * ``hadamard.py`` - ``hadamard_transform``, the 16-point random Hadamard
    transform (RHT);
  * ``noise.py`` - ``uniform_noise``/``draw_seeds``: counter-based uniform draws
    for stochastic rounding;
  * ``blocks.py`` - block scaling + rounding + dequantize of one 2-D operand in
    its physical layout (``_qdq``) (the operand shape rules: ``precision/gemm_shapes.py``);
  * ``compiled.py`` - the torch.compile'd variants and their cache;
  * here - ``quantize(x, fmt, operand, ...)``, the public entry point for one
    2-D GEMM operand whose reduction dim is last.

Conventions shared by all quantizers:
  * Element rounders saturate: finite values beyond the max and +-Inf round to
    +-max; NaN stays NaN; -0.0 stays -0.0.
  * ``quantize`` never turns a non-finite input into a finite output silently:
    a block whose amax is NaN or Inf dequantizes to NaN in every element (for
    ``fp8`` the block is the whole tensor; for ``nvfp4`` a non-finite tensor
    amax also makes the whole tensor NaN). All-zero blocks give zeros (no 0/0).
  * Shapes: the reduction dim must be a multiple of the format's block (and,
    for 2-D weight blocks, the other dim too). Otherwise ``quantize`` raises a
    ValueError naming format, dimension and block. We do not pad: a zero-padded
    tail block would silently get numerics the hardware formats do not have,
    and Llama hidden sizes are multiples of 128 anyway.

Layouts: the math is defined on the logical (rows, cols) operand. A caller may
pass a transposed view (the wgrad operands dYᵀ and Xᵀ are exactly that); it is
then processed in its physical layout ("colwise": blocks run down the columns
of the contiguous tensor), which reads memory contiguously and gives bitwise
the same result as quantizing ``x.contiguous()``. The result comes back in the
same layout, so it may be a non-contiguous (transposed) view.

Speed (one CPU thread; ``python -m experiments.bench.step``): eager PyTorch runs each
quantizer as 10-40 elementwise passes over memory (0.02-0.15 Gelem/s; the eager
paths use in-place ops, float8 casts and a magic-number E2M1 rounding to keep
passes and page-faulting temporaries down). ``compiled=True`` runs the same
functions through ``torch.compile``: one fused, vectorized kernel per format /
operand kind / layout / shape (0.3-1.2 Gelem/s), bit-identical to eager except
NaN payloads, compiled on first use (2-5 s each, cached on disk by inductor).
On CUDA tensors the Triton kernels of ``snip_kernels/`` run instead (same bits). A
failed compilation is retried once in a private cache, then falls back to eager;
every fallback is recorded once (``compiled.py``, ``precision/fallbacks.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.gemm_shapes import operand_shape_error
from megatron_snip.precision.profile_labels import label
from megatron_snip.precision.quantize.blocks import tensor_amax
from megatron_snip.precision.quantize.compiled import _run_qdq, cuda_kernels, kernel_failed
from megatron_snip.precision.quantize.noise import draw_seeds

__all__ = ["quantize"]

_IDENTITY = get_format("bf16")


def quantize(
    x: torch.Tensor,
    fmt: str,
    operand: Operand | str,
    *,
    generator: torch.Generator | None = None,
    hadamard: bool = False,
    amax: torch.Tensor | None = None,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Quantize-dequantize one GEMM operand in format ``fmt``.

    Args:
        x: (rows, cols) tensor, any float dtype (computed in fp32), with the
            GEMM's reduction dim LAST. May be a transposed view (processed in
            place of its contiguous base; same result). Not modified.
        fmt: format name (``formats.FORMATS``); ``"bf16"`` is the identity.
        operand: ACTIVATION, WEIGHT or GRADIENT - picks the element type
            (``fp8``: E5M2 for gradients), the block shape (2-D blocks for
            ``fp8_block``/``nvfp4`` weights) and stochastic rounding (``nvfp4``
            gradients).
        generator: source of the stochastic-rounding randomness, used iff the
            format rounds this operand stochastically (None: torch's default
            generator). Exactly one draw of two 32-bit seeds per call; element
            (i, j) then gets ``uniform_noise(rows, cols, seeds)[i, j]``.
        hadamard: rotate first: returns Q(x · H) with H the block-diagonal
            16-point random Hadamard transform along the last dim (amaxes and
            scales are those of the rotated tensor). Both wgrad operands get
            it, so their product approximates the unrotated one.
        amax: whole-tensor amax (of the rotated tensor when ``hadamard``)
            already reduced over the tensor-parallel group, so that shards
            agree with the unsharded tensor. Used by formats with a tensor scale
            (``fp8``, ``nvfp4``), ignored by the others. Default: local amax.
        amax_reduce: alternative to ``amax``: a callable applied to the local
            0-d tensor amax (e.g. an all-reduce MAX over the TP group); called
            exactly once for formats with a tensor scale, never otherwise.
        compiled: run through ``torch.compile`` (same numerics, 10-30x faster
            after a one-off compile per format/operand kind/layout/shape).

    Returns:
        fp32 tensor of x's shape (in x's layout, so possibly a transposed
        view): the dequantized - and, with ``hadamard``, rotated - operand.

    Raises:
        ValueError: unknown format; x not 2-D; a dim not a multiple of the
            format's block (``gemm_shapes.operand_shape_error``); both amax and amax_reduce.
    """
    operand = Operand(operand)
    with label("quantize", fmt, operand.value):  # a no-op unless a profiler records (profile_labels.py)
        return _quantize(x, fmt, operand, generator, hadamard, amax, amax_reduce, compiled)


def _quantize(x: torch.Tensor, fmt: str, operand: Operand, generator: torch.Generator | None, hadamard: bool,
              amax: torch.Tensor | None, amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None,
              compiled: bool) -> torch.Tensor:
    spec = get_format(fmt)
    error = operand_shape_error(x.shape, spec, operand, hadamard=hadamard)
    if error is not None:
        raise ValueError(error)
    if amax is not None and amax_reduce is not None:
        raise ValueError("quantize: pass either amax (already reduced) or amax_reduce (to reduce the local amax), not both")
    # The physical operand: x itself or, for a transposed view, its contiguous base. The Triton
    # kernels read bf16/fp16 directly (widened in registers), so on that path x is not copied to
    # fp32 first; every other variant computes on an fp32 copy (the same values: widening is exact).
    if not _kernel_path(x) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)  # keeps a transposed layout
    colwise = not x.is_contiguous() and x.t().is_contiguous()
    p = x.t() if colwise else x.contiguous()

    seeds = draw_seeds(generator, p.device) if spec.stochastic_for(operand) else None
    if amax is not None:
        amax = amax.detach().to(device=p.device, dtype=torch.float32).reshape(())
    if spec.uses_tensor_amax and amax_reduce is not None:
        # The collective sits between the local amax and the scales, so the rotated operand's
        # amax comes first: the kernels take it in a read-only pass (the rotation stays in
        # registers, and the quantize kernel rotates again); elsewhere rotate in a pass of its own.
        local = None
        if hadamard and _kernel_path(p):
            try:
                local = cuda_kernels().rotated_amax(p, colwise)
            except Exception as e:  # noqa: BLE001 - a kernel that fails to build or launch: fall back, once
                kernel_failed(e)
        if local is None:
            if hadamard:
                p = _run_qdq(p, _IDENTITY, operand, True, colwise, None, None, compiled)
                hadamard = False
            local = tensor_amax(p)
        amax = amax_reduce(local).to(torch.float32).reshape(())
    y = _run_qdq(p, spec, operand, hadamard, colwise, amax, seeds, compiled)
    return y.t() if colwise else y


def _kernel_path(p: torch.Tensor) -> bool:
    """Will ``_run_qdq`` hand ``p`` to the Triton kernels (a CUDA tensor, kernels importable)? Its one
    place in ``quantize`` (tests replace it to see what the kernel path is handed on CPU)."""
    return p.device.type == "cuda" and cuda_kernels() is not None
