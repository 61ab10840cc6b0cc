"""The 16-point random Hadamard transform (RHT) that nvfp4 applies to both wgrad operands."""

from __future__ import annotations

import torch

from megatron_snip.precision.formats import RHT_SIZE

# Transformer Engine's fixed wgrad sign vector (NVFP4 recipe), so our RHT matches TE's.
RHT_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def rht_matrix(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16x16 orthogonal matrix H = diag(RHT_SIGNS) · H16 / 4 (H16: Sylvester Hadamard, entries +-1)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < RHT_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64)
    return (signs[:, None] * h / RHT_SIZE**0.5).to(dtype=dtype, device=device)


def _rht_blocks(y3: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Apply H (or Hᵀ) along dim 1 of y3 (A, 16, B): H = diag(s) · H16 / 4.

    H16 is applied as a fast Walsh-Hadamard transform: four butterfly stages on
    the 16 slices y3[:, i] (pairs i, i+h for h = 8, 4, 2, 1), a fixed operation
    order that eager PyTorch and inductor reproduce bit for bit, in either
    memory layout. Sign flips and the 1/4 are exact.
    """
    # x · diag(s) first (exact sign flips, no pass for the +1s); the inverse applies s
    # last (Hᵀ = H16 · diag(s) / 4).
    v = [y3[:, i] if inverse or s > 0 else -y3[:, i] for i, s in enumerate(RHT_SIGNS)]
    for h in (8, 4, 2, 1):
        nxt = list(v)
        for i in range(RHT_SIZE):
            if not i & h:
                nxt[i], nxt[i + h] = v[i] + v[i + h], v[i] - v[i + h]
        v = nxt
    out = torch.stack(v, dim=1).mul_(0.25)
    if inverse:
        out.mul_(torch.tensor(RHT_SIGNS, dtype=out.dtype, device=out.device)[None, :, None])
    return out


def _rht_physical(p: torch.Tensor, colwise: bool, inverse: bool = False) -> torch.Tensor:
    """RHT along the logical last dim of a physical tensor (see ``_qdq`` for layouts)."""
    if colwise:  # p is (C, R): logical columns are physical rows
        return _rht_blocks(p.reshape(p.shape[0] // RHT_SIZE, RHT_SIZE, p.shape[1]), inverse).reshape(p.shape)
    return _rht_blocks(p.reshape(-1, RHT_SIZE, 1), inverse).reshape(p.shape)


def hadamard_transform(x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """x · H (``inverse=True``: x · Hᵀ = x · H⁻¹) along the last dim, in independent 16-blocks.

    Args:
        x: fp32 (..., C) with C a multiple of 16.
    Returns:
        fp32 tensor of x's shape. H = ``rht_matrix()`` is orthogonal, so
        rotating both operands of a GEMM along its reduction dim leaves the
        product unchanged: (A·H)(B·H)ᵀ = A·Bᵀ.
    """
    if x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"hadamard_transform: last dim {x.shape[-1]} is not a multiple of the {RHT_SIZE}-point transform"
        )
    return _rht_physical(x.contiguous(), colwise=False, inverse=inverse)
