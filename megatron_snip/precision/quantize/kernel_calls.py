"""The Triton quantize kernels' callers: a format and operand kind in, plain constants to
``snip_kernels.quantize.launch_qdq`` out (``snip_kernels/`` imports nothing of megatron_snip).

``qdq`` is ``blocks._qdq`` and ``scaled_operand`` is ``scaled.scaled_elements`` + the float8
cast, each as one fused kernel launch, bit for bit (tests/unit/test_kernels.py under
``TRITON_INTERPRET=1``, scripts/gpu_check.sh on CUDA). For a tensor scale the amax is taken
here (``tensor_amax``, one pass; ``rotated_amax`` under the RHT) and handed to the kernel, which
derives the scales as the reference's ``_tensor_scales`` / ``_nvfp4_tensor_scales`` do. Importing
this module imports Triton: ``compiled.cuda_kernels`` does so lazily.
"""

from __future__ import annotations

import torch

from megatron_snip.precision.formats import E4M3, Format, Operand, Scaling, get_format
from megatron_snip.precision.quantize.bits import _F32_MAX
from megatron_snip.precision.quantize.blocks import (
    _MAX_MANTISSA_BITS,
    _NVFP4_TENSOR_MAX,
    _RCP_E2M1_MAX,
    tensor_amax,
)
from megatron_snip.precision.quantize.hadamard import RHT_SIGNS, RHT_SIZE
from megatron_snip.precision.quantize.noise import _MIX_MUL1, _MIX_MUL2
from snip_kernels.quantize import launch_grid, launch_qdq

__all__ = ["bytes_moved", "qdq", "rotated_amax", "scaled_operand"]

_SCALING_CODE = {Scaling.NONE: 0, Scaling.TENSOR: 1, Scaling.BLOCK_POW2: 2, Scaling.BLOCK_E8M0: 3,
                 Scaling.BLOCK_E4M3_TENSOR: 4, Scaling.BLOCK_FP32: 5}
_RHT_NEG_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)  # bit i set: sign i is -1
_IDENTITY = get_format("bf16")
_AMAX_ONLY = 6  # _qdq_kernel's SCALING code for the amax-only pass


def _tile(spec: Format, operand: Operand, hadamard: bool) -> tuple[int, int, int, bool]:
    """(TR, NB, BS, BLOCK_2D): rows per tile, blocks per tile row, block columns, 2-D blocks."""
    if spec.scaling in (Scaling.NONE, Scaling.TENSOR):
        return 16, 8 if hadamard else 1, RHT_SIZE if hadamard else 128, False
    br, bc = spec.block_for(operand)
    nb = max(1, 128 // bc)
    return (br, nb, bc, True) if br > 1 else (16, nb, bc, False)


_KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # loaded and widened in registers


def qdq(p: torch.Tensor, spec: Format, operand: Operand, hadamard: bool, colwise: bool,
        amax: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor:
    """``quantize.blocks._qdq`` as one fused Triton kernel (same arguments, same bits).

    Args:
        p: contiguous physical tensor, fp32, bf16 or fp16 (the kernel widens it in registers, exactly:
            no fp32 copy is made): the logical operand (``colwise=False``) or its transpose
            (``colwise=True``); a CUDA tensor (or CPU under TRITON_INTERPRET=1).
        amax: tensor amax (of the rotated operand), or None for the local one.
        seeds: int32 (2,) stochastic-rounding seeds on p's device, or None for RNE.
    Returns:
        the fp32 dequantized (and, with ``hadamard``, rotated) operand in p's layout.

    Passes over memory (``bytes_moved``): one read of p and one fp32 write; a format with a tensor
    scale and no given ``amax`` first reads p once more for it (``tensor_amax``, or with
    ``hadamard`` the kernel's amax-only mode over the rotated tiles: the rotation is never written).
    """
    assert p.dtype in _KERNEL_INPUT_DTYPES and p.is_contiguous() and p.dim() == 2, (p.dtype, p.shape)
    rows, cols = (p.shape[1], p.shape[0]) if colwise else (p.shape[0], p.shape[1])
    stride_r, stride_c = (1, p.shape[1]) if colwise else (p.shape[1], 1)
    elem = spec.element_for(operand) if spec.quantizes else E4M3  # E4M3: placeholder constants for NONE
    tr, nb, bs, block_2d = _tile(spec, operand, hadamard)
    # the kernel derives the tensor scales from the amax itself (no host-side scalar launches)
    if spec.quantizes and spec.uses_tensor_amax:
        if amax is None:  # nvfp4: = the max of the block amaxes
            amax = rotated_amax(p, colwise) if hadamard else tensor_amax(p)
        scalars = amax.to(torch.float32).reshape(1)
    else:
        scalars = torch.empty(1, dtype=torch.float32, device=p.device)  # unused
    y = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    _launch(p, y, scalars, seeds, scalars, rows, cols, stride_r, stride_c, spec, elem, tr, nb, bs, block_2d,
            hadamard, out_elements=False)
    return y


def rotated_amax(p: torch.Tensor, colwise: bool) -> torch.Tensor:
    """The 0-d fp32 amax of the RHT-rotated operand (``_qdq(p, bf16, hadamard=True)``'s amax) in one read
    of p: the kernel rotates each tile in registers and writes one amax per program (a few KiB),
    reduced here. NaN propagates (the kernel's int32 maxima order NaN above Inf)."""
    rows, cols = (p.shape[1], p.shape[0]) if colwise else (p.shape[0], p.shape[1])
    stride_r, stride_c = (1, p.shape[1]) if colwise else (p.shape[1], 1)
    tr, nb, bs, _ = _tile(_IDENTITY, Operand.ACTIVATION, True)
    partial = torch.empty(launch_grid(rows, cols, tr, nb, bs), dtype=torch.float32, device=p.device)
    scalars = torch.empty(1, dtype=torch.float32, device=p.device)  # unused
    launch_qdq(p, partial, scalars, None, partial, rows, cols, stride_r, stride_c, tr=tr, nb=nb, bs=bs,
               block_2d=False, scaling=_AMAX_ONLY, emin=E4M3.emin, emax=E4M3.emax, mbits=E4M3.mbits,
               maxv=E4M3.max, round_up=False, max_mant=0, hadamard=True, rht_neg=_RHT_NEG_MASK, f32max=_F32_MAX,
               mix_mul1=_MIX_MUL1, mix_mul2=_MIX_MUL2, out_elements=False)
    return partial.amax()


def _launch(x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c, spec, elem, tr, nb, bs, block_2d,
            hadamard, out_elements) -> None:
    """``snip_kernels.quantize.launch_qdq`` with the format's and element's constants spelled out."""
    launch_qdq(
        x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c,
        tr=tr, nb=nb, bs=bs, block_2d=block_2d, scaling=_SCALING_CODE[spec.scaling],
        emin=elem.emin, emax=elem.emax, mbits=elem.mbits, maxv=elem.max,
        round_up=bool(spec.e8m0_round_up), max_mant=_MAX_MANTISSA_BITS[elem.name],
        hadamard=hadamard, rht_neg=_RHT_NEG_MASK, f32max=_F32_MAX, mix_mul1=_MIX_MUL1, mix_mul2=_MIX_MUL2,
        out_elements=out_elements, tensor_max=_NVFP4_TENSOR_MAX, rcp_max=_RCP_E2M1_MAX,
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
    if spec.scaling is Scaling.TENSOR:  # the kernel derives the scales from the amax, writes the decode scale
        scalars = (tensor_amax(x) if amax is None else amax).to(torch.float32).reshape(1)
        scales_out = torch.empty((), dtype=torch.float32, device=x.device)
    else:
        scalars = torch.empty(1, dtype=torch.float32, device=x.device)  # unused
        br, bc = spec.block_for(operand)
        scales_out = torch.empty(rows // br, cols // bc, dtype=torch.float32, device=x.device)
    tr, nb, bs, block_2d = _tile(spec, operand, False)
    elements = torch.empty(rows, cols, dtype=_FLOAT8[elem.name], device=x.device)
    _launch(x, elements, scalars, None, scales_out, rows, cols, x.stride(0), x.stride(1), spec, elem, tr, nb, bs,
            block_2d, False, out_elements=True)
    return elements, scales_out


_AMAX_TILE_ELEMENTS = 16 * 128  # rotated_amax's tile (_tile of the identity with the RHT): one fp32 partial each


def bytes_moved(fmt: str | Format, numel: int, dtype: torch.dtype, rht: bool = False, *,
                operand: Operand = Operand.ACTIVATION, scaled: bool = False, amax_given: bool = False) -> int:
    """Bytes of device memory one call of ``qdq`` (``scaled=False``) or ``scaled_operand`` (``scaled=True``)
    reads and writes for an operand of ``numel`` elements stored as ``dtype`` (``rht``: ``qdq``'s
    ``hadamard``; ``amax_given``: the tensor amax is passed in, e.g. already reduced over TP).

    Derivation, per element, with b = ``dtype``'s size (4 fp32, 2 bf16):
      * the quantize kernel reads the input once (b) - the RHT, when on, rotates the tile in
        registers for every block width (no rotated copy in memory, no pass of its own) - and
        writes once: ``qdq`` the dequantized fp32 operand (4), ``scaled_operand`` the float8 codes
        (1) plus, for block scales, one fp32 decode scale per block (4 / block elements: 4/128 for
        1x128 tiles, 4/16384 for 128x128 blocks);
      * a format with a tensor scale (``fp8``, ``nvfp4``) and no given amax reads the input once
        more first for it: ``tensor_amax`` (``torch.aminmax``, one pass, no |x| temporary) or, with
        the RHT, the kernel's amax-only mode (``rotated_amax``: the rotated tile's amax; one fp32
        partial per 16 x 128 tile written and read back: 8 / 2048 per element).
    So ``qdq``: b + 4 per element (block scales), 2b + 4 (tensor scale; + 8/2048 with the RHT);
    ``scaled_operand`` of bf16: 3 + 4/128 (``fp8_block`` 1x128), 5 (``fp8``). Not counted: tensors of
    one element (the 0-d amax and the scalar ops that derive it, the kernel's amax argument, the
    ``fp8`` 0-d decode scale) and the two stochastic-rounding seeds, under 100 bytes per call.
    Shapes are assumed to fill the tiles (rows % 16 == cols % 128 == 0, 128x128 blocks whole), as
    every 1B-layer shape does. tests/unit/test_kernel_traffic.py counts the bytes each call really
    moves under the Triton interpreter and checks them against this.
    """
    spec = get_format(fmt) if isinstance(fmt, str) else fmt
    b = torch.empty((), dtype=dtype).element_size()
    total = numel * b  # the quantize kernel's read
    if scaled:
        total += numel  # the float8 codes
        if spec.scaling is not Scaling.TENSOR:  # (a tensor scale's 0-d decode scale is not counted)
            br, bc = spec.block_for(operand)
            total += 4 * numel // (br * bc)
    else:
        total += 4 * numel
    if spec.quantizes and spec.uses_tensor_amax and not amax_given:
        total += numel * b + (8 * -(-numel // _AMAX_TILE_ELEMENTS) if rht else 0)
    return total
