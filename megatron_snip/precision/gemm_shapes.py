"""Can a format's blocks tile a GEMM's operands? The one home of the operand-shape rules.

Asked once per plan - at ``Trainer.apply_plan`` through ``LlamaModel.plan_shape_errors``,
and by the dry run (``sizing/``) - not on every GEMM call.

For a linear with TP-local weight W (N, K) run on T tokens (a micro-batch; the full
sequence even under sequence parallelism), each GEMM's operands as the quantizer sees
them, reduction dim last (``precision/gemm.py``'s docstring has the math)::

    fprop  X   (T, K) activation    W   (N, K) weight
    dgrad  dY  (T, N) gradient      Wᵀ  (K, N) weight
    wgrad  dYᵀ (N, T) gradient      Xᵀ  (K, T) activation   (both rotated by the RHT
                                                               when the format says so)

An operand fits its format when the reduction dim is a multiple of the format's block for
that operand kind (``Format.block_for``), the other dim a multiple of the block's rows (2-D
weight blocks), the reduction dim a multiple of the Hadamard transform's size when the
operand is rotated, and it has at most ``MAX_OPERAND_ELEMENTS`` elements.
"""

from __future__ import annotations

from megatron_snip.precision.formats import RHT_SIZE, Format, Operand, get_format
from megatron_snip.precision.plan import GEMMS

__all__ = ["GEMM_OPERANDS", "MAX_OPERAND_ELEMENTS", "gemm_operands", "gemm_shape_error", "operand_shape_error"]

# The stochastic-rounding noise counts elements in uint32 (precision/quantize.py).
MAX_OPERAND_ELEMENTS = 2**32

# gemm -> its two operands: (name, kind, (rows, cols) in terms of the weight's N, K and T tokens).
GEMM_OPERANDS: dict[str, tuple[tuple[str, Operand, tuple[str, str]], ...]] = {
    "fprop": (("X", Operand.ACTIVATION, ("T", "K")), ("W", Operand.WEIGHT, ("N", "K"))),
    "dgrad": (("dY", Operand.GRADIENT, ("T", "N")), ("W^T", Operand.WEIGHT, ("K", "N"))),
    "wgrad": (("dY^T", Operand.GRADIENT, ("N", "T")), ("X^T", Operand.ACTIVATION, ("K", "T"))),
}
assert tuple(GEMM_OPERANDS) == GEMMS


def operand_shape_error(
    shape: tuple[int, ...], fmt: str | Format, operand: Operand | str, *, hadamard: bool = False
) -> str | None:
    """Why a (rows, cols) operand (reduction dim last) does not fit ``fmt``'s blocks, or None if it does.

    ``hadamard``: the operand is rotated by the RHT along its reduction dim first.
    """
    spec = get_format(fmt) if isinstance(fmt, str) else fmt
    operand = Operand(operand)
    if len(shape) != 2:
        return (f"quantize expects a 2-D (rows, cols) operand with the GEMM's reduction dim last; "
                f"got shape {tuple(shape)}")
    rows, cols = shape
    if rows * cols > MAX_OPERAND_ELEMENTS:
        return f"quantize: operand {rows}x{cols} has more than 2**32 elements; split it"
    if hadamard and cols % RHT_SIZE:
        return (f"the {RHT_SIZE}-point Hadamard transform runs along the reduction (last) dim, which has size {cols}; "
                f"it must be a multiple of {RHT_SIZE}")
    if not spec.quantizes:
        return None
    br, bc = spec.block_for(operand)
    if bc and cols % bc:
        return (f"format {spec.name!r} quantizes {operand.value} operands in blocks of {bc} along the reduction "
                f"(last) dim, which has size {cols}; make that dim a multiple of {bc} (for a sharded linear: "
                f"the local size after tensor parallelism) or pick another format for this GEMM")
    if br > 1 and rows % br:
        return (f"format {spec.name!r} quantizes {operand.value} operands in {br}x{bc} blocks, but the "
                f"non-reduction (first) dim has size {rows}; make it a multiple of {br} or pick another format")
    return None


def gemm_operands(gemm: str, n: int, k: int, tokens: int) -> tuple[tuple[str, Operand, tuple[int, int]], ...]:
    """``gemm``'s two operands (name, kind, (rows, cols)) for a linear with TP-local weight
    (``n``, ``k``) on ``tokens`` tokens: the first is a scaled-mm's ``a``, the second its ``b``
    (the GEMM is a·bᵀ, both with the reduction dim last)."""
    if gemm not in GEMM_OPERANDS:
        raise ValueError(f"gemm={gemm!r} is not one of {GEMMS}")
    dims = {"N": n, "K": k, "T": tokens}
    return tuple((name, operand, (dims[rows], dims[cols])) for name, operand, (rows, cols) in GEMM_OPERANDS[gemm])


def gemm_shape_error(fmt: str | Format, gemm: str, n: int, k: int, tokens: int) -> str | None:
    """Why ``gemm`` of a linear with TP-local weight (``n``, ``k``) on ``tokens`` tokens cannot run in ``fmt``.

    Returns None when both operands fit (see the module docstring), else each misfit as
    ``"<operand> (<rows>, <cols>): <reason>"``, joined by "; " - e.g. ``"W^T (128, 200): format
    'fp8_block' quantizes weight operands in blocks of 128 ..."``.
    """
    spec = get_format(fmt) if isinstance(fmt, str) else fmt
    hadamard = gemm == "wgrad" and spec.wgrad_hadamard
    misfits = []
    for name, operand, shape in gemm_operands(gemm, n, k, tokens):
        error = operand_shape_error(shape, spec, operand, hadamard=hadamard)
        if error is not None:
            misfits.append(f"{name} {shape}: {error}")
    return "; ".join(misfits) or None
