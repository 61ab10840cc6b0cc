"""Counter-based uniform draws for stochastic rounding (the same bits on every device and in kernels)."""

from __future__ import annotations

import torch

# A 2-round 32-bit integer mixer (C. Wellons' hash-prospector, shifts 16/15/15),
# on int32 tensors holding uint32 bit patterns: multiplication wraps mod 2**32
# (two's complement; every PyTorch backend and Triton do this), right shifts are
# made logical by masking. The values are pinned by a golden test against
# pure-Python integer arithmetic, so a platform that behaved otherwise would fail
# loudly. (int64 arithmetic would avoid relying on wrap-around but is 2x slower.)
_MIX_MUL1, _MIX_MUL2 = 0x21F0AAAD, 0x735A2D97


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MIX_MUL1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _MIX_MUL2
    return h ^ ((h >> 15) & 0x1FFFF)


def _mix32_(h: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``_mix32`` in place on ``h`` with one scratch tensor: the same values without the ~10
    full-size temporaries eager mode would allocate (2x faster there; compiled code is fused
    either way, so torch.compile traces the functional version)."""
    for shift, mask, mul in ((16, 0xFFFF, _MIX_MUL1), (15, 0x1FFFF, _MIX_MUL2), (15, 0x1FFFF, None)):
        torch.bitwise_right_shift(h, shift, out=tmp)
        h ^= tmp.bitwise_and_(mask)
        if mul is not None:
            h *= mul
    return h


def _uniform_from_counter(counter: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) fp32 (24 random bits) from int32 counters and two int32 seeds (uint32 bit patterns)."""
    if torch.compiler.is_compiling():
        h = _mix32(counter + seeds[0])
        h = _mix32(h ^ seeds[1])
        return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (2.0**-24)
    h = counter + seeds[0]
    tmp = torch.empty_like(h)
    _mix32_(h, tmp)
    h ^= seeds[1]
    _mix32_(h, tmp)
    h >>= 8
    u = tmp.view(torch.float32)  # the scratch, reused for the result
    return u.copy_(h.bitwise_and_(0xFFFFFF)).mul_(2.0**-24)


def draw_seeds(generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """Two 32-bit seeds (an int32 tensor on ``device``) drawn from ``generator`` (None: torch's default)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    seeds = torch.randint(-(2**31), 2**31, (2,), generator=generator, dtype=torch.int32, device=gen_device)
    return seeds.to(device)


def _noise_physical(rows: int, cols: int, colwise: bool, seeds: torch.Tensor) -> torch.Tensor:
    """Noise for the logical (rows, cols) operand, laid out like its physical tensor.

    Element (i, j) of the logical operand always gets counter i * cols + j
    (mod 2**32), so the draws do not depend on the memory layout.
    """
    r = torch.arange(rows, dtype=torch.int32, device=seeds.device) * cols
    c = torch.arange(cols, dtype=torch.int32, device=seeds.device)
    counter = (c[:, None] + r[None, :]) if colwise else (r[:, None] + c[None, :])
    return _uniform_from_counter(counter, seeds)


def uniform_noise(rows: int, cols: int, seeds: torch.Tensor) -> torch.Tensor:
    """The (rows, cols) uniform [0, 1) draws ``quantize`` uses for stochastic rounding with ``seeds``."""
    if rows * cols > 2**32:
        raise ValueError(f"uniform_noise: {rows}x{cols} operand has more than 2**32 elements (counter overflow)")
    return _noise_physical(rows, cols, False, seeds)
