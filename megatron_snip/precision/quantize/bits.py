"""Exact fp32 power-of-two helpers by bit manipulation (no libm: identical eager and compiled).

Used by element rounding (``rounding.py``) and block scaling (``blocks.py``).
"""

from __future__ import annotations

import struct

import torch

_F32_MAX = torch.finfo(torch.float32).max


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]



def _exp2i(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32, exactly, for an int32 tensor k in [-127, 127].

    Built from the exponent bits; k = -127 is the one fp32 subnormal we need
    (the smallest E8M0 scale).
    """
    normal = (k + 127) << 23
    subnormal = torch.full_like(k, 1 << 22)  # bit pattern of 2**-127
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _rdiv(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t as one correctly rounded fp32 division (TE's ``max / amax``).

    ``c / t`` on a tensor means ``reciprocal(t) * c`` in PyTorch (eager and
    inductor alike), which can differ by an ulp.
    """
    return torch.div(torch.full_like(t, c), t)


def _div_rn(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c as one correctly rounded fp32 division, on every device.

    On CUDA, ``t / c`` with a Python (or CPU 0-d) scalar ``c`` is computed as
    ``t * fl32(1 / c)`` (PyTorch's div_true kernel), which is one ulp off for e.g. c = 6;
    dividing by a tensor on t's device is IEEE division everywhere.
    """
    return torch.div(t, torch.full_like(t, c))


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) (int32) of a non-negative fp32 tensor, from its exponent bits.

    Exact for normal numbers; gives -127 for 0 and fp32 subnormals and 128 for
    Inf/NaN (callers clamp or mask these).
    """
    return (a.view(torch.int32) >> 23) - 127


def _mantissa_bits(a: torch.Tensor) -> torch.Tensor:
    """The 23 fraction bits (int32) of a non-negative fp32 tensor."""
    return a.view(torch.int32) & 0x7FFFFF
