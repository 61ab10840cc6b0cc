"""Operands for scaled-mm GEMMs: float8 elements plus decode scales, the reference quantization bit for bit.

``quantize(x, ...)`` returns the dequantized operand; ``quantize_scaled`` returns what it
multiplies together - the on-grid elements (stored as float8, exactly) and the fp32 decode
scales - so that ``dequantize(quantize_scaled(x, ...)) == quantize(x, ...)`` bitwise and a
scaled-mm can multiply the elements directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.gemm_shapes import operand_shape_error
from megatron_snip.precision.quantize.blocks import scaled_elements, tensor_amax
from megatron_snip.precision.quantize.compiled import cuda_kernels, kernel_failed

__all__ = ["SCALED_FORMATS", "ScaledOperand", "dequantize", "quantize_scaled"]

# Formats whose operands quantize_scaled produces: FP8 elements with fp32 (tensor) or
# power-of-two (block) decode scales, no stochastic rounding, no Hadamard transform.
SCALED_FORMATS: tuple[str, ...] = ("fp8", "fp8_block")
_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class ScaledOperand:
    """One GEMM operand as a scaled-mm takes it.

    Attributes:
        elements: (rows, cols) float8 (E4M3 or E5M2), row-major, reduction dim last.
        scale: fp32 decode scales: 0-d (per tensor) or (rows / br, cols / bc) per block.
    """

    elements: torch.Tensor
    scale: torch.Tensor


def quantize_scaled(
    x: torch.Tensor,
    fmt: str,
    operand: Operand | str,
    *,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ScaledOperand:
    """The elements and decode scales ``quantize(x, fmt, operand, amax_reduce=...)`` multiplies.

    Args:
        x: (rows, cols) tensor, any float dtype, reduction dim last; may be a transposed view.
        fmt: one of ``SCALED_FORMATS``.
        operand: picks the element (``fp8``: E5M2 for gradients) and the block shape.
        amax_reduce: as in ``quantize``: applied once to the local tensor amax (``fp8``).
    Raises:
        ValueError: a format outside ``SCALED_FORMATS``, or a shape its blocks do not fit.
    """
    spec = get_format(fmt)
    operand = Operand(operand)
    if spec.name not in SCALED_FORMATS:
        raise ValueError(f"quantize_scaled: format {fmt!r} is not one of {SCALED_FORMATS}")
    error = operand_shape_error(x.shape, spec, operand)
    if error is not None:
        raise ValueError(error)
    amax = None
    if amax_reduce is not None and spec.uses_tensor_amax:
        amax = amax_reduce(tensor_amax(x)).to(torch.float32).reshape(())
    if x.device.type == "cuda" and cuda_kernels() is not None:
        try:  # one fused pass: x (any layout, bf16 or fp32) -> float8 elements + scales
            return ScaledOperand(*cuda_kernels().scaled_operand(x, spec, operand, amax))
        except Exception as e:  # noqa: BLE001 - a kernel that fails to build or launch: fall back, once
            kernel_failed(e)
    p = x.to(torch.float32).contiguous()  # rowwise: the same bits as the reference's colwise path
    elements, scale = scaled_elements(p, spec, operand, amax)
    elem = spec.element_for(operand)
    assert elem is not None
    return ScaledOperand(elements.to(_FLOAT8[elem.name]), scale)


def dequantize(op: ScaledOperand) -> torch.Tensor:
    """fp32 elements x decode scales (broadcast over blocks): ``quantize``'s result, bit for bit."""
    e = op.elements.to(torch.float32)
    if op.scale.dim() == 0:
        return e * op.scale
    br, bc = e.shape[0] // op.scale.shape[0], e.shape[1] // op.scale.shape[1]
    return (e.reshape(op.scale.shape[0], br, op.scale.shape[1], bc) * op.scale[:, None, :, None]).reshape(e.shape)
