"""The Triton quantize kernels' callers: a format and operand kind in, plain constants to
``kernels.quantize.launch_qdq`` out (``kernels/`` imports nothing of megatron_snip).

``qdq`` is ``blocks._qdq`` and ``scaled_operand`` is ``scaled.scaled_elements`` + the float8
cast, each as one fused kernel launch, bit for bit (tests/unit/test_kernels.py under
``TRITON_INTERPRET=1``, scripts/gpu_check.sh on CUDA). The tensor scales are the reference's own
(``_tensor_scales``, ``_nvfp4_tensor_scales``), computed here and handed to the kernel in
``scalars``. Importing this module imports Triton: ``compiled.cuda_kernels`` does so lazily.
"""

from __future__ import annotations

import torch

from kernels.quantize import launch_qdq
from megatron_snip.precision.formats import E4M3, Format, Operand, Scaling, get_format
from megatron_snip.precision.quantize.bits import _F32_MAX
from megatron_snip.precision.quantize.blocks import (
    _MAX_MANTISSA_BITS,
    _RCP_E2M1_MAX,
    _nvfp4_tensor_scales,
    _tensor_scales,
)
from megatron_snip.precision.quantize.hadamard import RHT_SIGNS, RHT_SIZE
from megatron_snip.precision.quantize.noise import _MIX_MUL1, _MIX_MUL2

__all__ = ["qdq", "scaled_operand", "separate_rotation"]

_SCALING_CODE = {Scaling.NONE: 0, Scaling.TENSOR: 1, Scaling.BLOCK_POW2: 2, Scaling.BLOCK_E8M0: 3,
                 Scaling.BLOCK_E4M3_TENSOR: 4, Scaling.BLOCK_FP32: 5}
_RHT_NEG_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)  # bit i set: sign i is -1
_IDENTITY = get_format("bf16")


def _tile(spec: Format, operand: Operand, hadamard: bool) -> tuple[int, int, int, bool]:
    """(TR, NB, BS, BLOCK_2D): rows per tile, blocks per tile row, block columns, 2-D blocks."""
    if spec.scaling in (Scaling.NONE, Scaling.TENSOR):
        return 16, 8 if hadamard else 1, RHT_SIZE if hadamard else 128, False
    br, bc = spec.block_for(operand)
    nb = max(1, 128 // bc)
    return (br, nb, bc, True) if br > 1 else (16, nb, bc, False)


def separate_rotation(spec: Format, operand: Operand, hadamard: bool, amax_given: bool) -> bool:
    """Whether ``qdq`` rotates in a pass of its own (the same butterflies) before quantizing: when
    the tensor scale needs the rotated tensor's amax first, or the format's blocks are not the
    16-blocks rotated in-tile (``kernel_traffic.qdq_traffic`` counts that pass)."""
    return hadamard and spec.quantizes and (
        (spec.uses_tensor_amax and not amax_given) or _tile(spec, operand, True)[2] != RHT_SIZE)


def qdq(p: torch.Tensor, spec: Format, operand: Operand, hadamard: bool, colwise: bool,
        amax: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor:
    """``quantize.blocks._qdq`` as one fused Triton kernel (same arguments, same bits).

    Args:
        p: contiguous fp32 physical tensor: the logical operand (``colwise=False``) or its
            transpose (``colwise=True``); a CUDA tensor (or CPU under TRITON_INTERPRET=1).
        amax: tensor amax (of the rotated operand), or None for the local one.
        seeds: int32 (2,) stochastic-rounding seeds on p's device, or None for RNE.
    Returns:
        the dequantized (and, with ``hadamard``, rotated) operand in p's layout.
    """
    assert p.dtype == torch.float32 and p.is_contiguous() and p.dim() == 2
    rows, cols = (p.shape[1], p.shape[0]) if colwise else (p.shape[0], p.shape[1])
    stride_r, stride_c = (1, p.shape[1]) if colwise else (p.shape[1], 1)
    if separate_rotation(spec, operand, hadamard, amax is not None):
        p = qdq(p, _IDENTITY, operand, True, colwise, None, None)
        hadamard = False
    elem = spec.element_for(operand) if spec.quantizes else E4M3  # E4M3: placeholder constants for NONE
    scalars = torch.zeros(4, dtype=torch.float32, device=p.device)
    if spec.scaling is Scaling.TENSOR:
        scale, scale_inv = _tensor_scales(p.abs().amax() if amax is None else amax, elem)
        scalars[0], scalars[1] = scale, scale_inv
    elif spec.scaling is Scaling.BLOCK_E4M3_TENSOR:
        a = p.abs().amax() if amax is None else amax  # = the max of the block amaxes
        s_enc, s_dec = _nvfp4_tensor_scales(a)
        scalars[0], scalars[1], scalars[2] = s_enc * _RCP_E2M1_MAX, s_dec, a
    tr, nb, bs, block_2d = _tile(spec, operand, hadamard)
    y = torch.empty_like(p)
    _launch(p, y, scalars, seeds, scalars, rows, cols, stride_r, stride_c, spec, elem, tr, nb, bs, block_2d,
            hadamard, out_elements=False)
    return y


def _launch(x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c, spec, elem, tr, nb, bs, block_2d,
            hadamard, out_elements) -> None:
    """``kernels.quantize.launch_qdq`` with the format's and element's constants spelled out."""
    launch_qdq(
        x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c,
        tr=tr, nb=nb, bs=bs, block_2d=block_2d, scaling=_SCALING_CODE[spec.scaling],
        emin=elem.emin, emax=elem.emax, mbits=elem.mbits, maxv=elem.max,
        round_up=bool(spec.e8m0_round_up), max_mant=_MAX_MANTISSA_BITS[elem.name],
        hadamard=hadamard, rht_neg=_RHT_NEG_MASK, f32max=_F32_MAX, mix_mul1=_MIX_MUL1, mix_mul2=_MIX_MUL2,
        out_elements=out_elements,
    )

_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def scaled_operand(x: torch.Tensor, spec: Format, operand: Operand,
                   amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize.blocks.scaled_elements`` + the float8 cast in one pass: a scaled-mm's operand.

    Args:
        x: (rows, cols) logical operand, any float dtype, any strides (a transposed view is
            read in place); reduction dim last.
        spec: ``fp8`` (per-tensor scales) or ``fp8_block`` (power-of-two blocks).
        amax: tensor amax reduced over TP, or None for the local one (``fp8`` only).
    Returns:
        (elements: row-major (rows, cols) float8, decode scales: fp32 0-d or
         (rows / br, cols / bc)) - the values ``scaled_elements`` returns, bit for bit.
    """
    assert spec.scaling in (Scaling.TENSOR, Scaling.BLOCK_POW2) and x.dim() == 2
    elem = spec.element_for(operand)
    rows, cols = x.shape
    scalars = torch.zeros(4, dtype=torch.float32, device=x.device)
    if spec.scaling is Scaling.TENSOR:
        scale, scale_inv = _tensor_scales(x.abs().amax().float() if amax is None else amax, elem)
        scalars[0], scalars[1] = scale, scale_inv
        scales_out = scale_inv
    else:
        br, bc = spec.block_for(operand)
        scales_out = torch.empty(rows // br, cols // bc, dtype=torch.float32, device=x.device)
    tr, nb, bs, block_2d = _tile(spec, operand, False)
    elements = torch.empty(rows, cols, dtype=_FLOAT8[elem.name], device=x.device)
    _launch(x, elements, scalars, None, scales_out, rows, cols, x.stride(0), x.stride(1), spec, elem, tr, nb, bs,
            block_2d, False, out_elements=True)
    return elements, scales_out
