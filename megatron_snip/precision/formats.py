"""Format specifications: what each precision name means.

A format is data: its element types, block geometry and scaling rule. The
quantize-dequantize math lives in ``quantize.py``; backends and plans refer to
formats by name (``"bf16"``, ``"fp8"``, ...).

Blocks always run along a GEMM's reduction dimension (see ARCHITECTURE.md,
"Numerics conventions"): an operand is presented to the quantizer as a 2-D
tensor whose *last* dimension is the reduction dimension.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Operand(str, enum.Enum):
    """Which kind of GEMM operand is being quantized (it picks element type and blocking)."""

    ACTIVATION = "activation"  # X (fprop, wgrad)
    WEIGHT = "weight"  # W (fprop, dgrad)
    GRADIENT = "gradient"  # dY (dgrad, wgrad)


@dataclass(frozen=True)
class Format:
    """One precision format.

    Attributes:
        name: the name plans and configs use.
        bits: element width in bits (16 for bf16).
        block: 1-D block length along the reduction dim for activations and
            gradients (0 = one scale per tensor, or no scaling for bf16).
        weight_block: (rows, cols) 2-D block for weights, or None when weights
            use the same 1-D blocks as activations.
        is_fp4: counts towards the FP4 FLOP share.
        description: one line for tables and errors.
    """

    name: str
    bits: int
    block: int
    weight_block: tuple[int, int] | None
    is_fp4: bool
    description: str

    def block_for(self, operand: Operand) -> tuple[int, int]:
        """(rows, cols) block of ``operand`` viewed with the reduction dim last; (1, 0) = no blocking."""
        if operand is Operand.WEIGHT and self.weight_block is not None:
            return self.weight_block
        return (1, self.block)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("bf16", 16, 0, None, False, "BF16 reference (no scaling)"),
        Format("fp8", 8, 0, None, False, "E4M3 fwd / E5M2 grad, per-tensor current scaling"),
        Format("fp8_block", 8, 128, (128, 128), False, "E4M3, 1x128 tiles, 128x128 weight blocks, pow2 scales"),
        Format("mxfp8", 8, 32, None, False, "E4M3, 32-element blocks, E8M0 scales (OCP MX)"),
        Format("nvfp4", 4, 16, (16, 16), True, "E2M1, 16-element blocks, E4M3 scales x FP32 tensor scale"),
        Format("mxfp4", 4, 32, None, True, "E2M1, 32-element blocks, E8M0 scales (OCP MX)"),
    )
}

FP4_FORMATS = frozenset(name for name, f in FORMATS.items() if f.is_fp4)


def get_format(name: str) -> Format:
    """Look up a format by name; ValueError naming the choices otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown precision format {name!r}; choose one of {sorted(FORMATS)}") from None
