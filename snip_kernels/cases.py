"""The input classes bit-exactness checks run on (tests/unit/test_kernels.py, scripts/gpu_check.py).

The reference tests' classes (tests/unit/test_quantize.py): scaled Gaussians spanning many
binades, a single outlier, all-zero blocks, fp32 subnormals, E4M3/E2M1 midpoints, values past
the element max, NaN and +-Inf, bf16-representable values.
"""

from __future__ import annotations

import torch

__all__ = ["input_classes"]


def input_classes(rows: int, cols: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """name -> fp32 (rows, cols) CPU tensor; rows >= 4, cols >= 32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).mul(12).sub(6).exp2()
    out = {"gaussian": x}
    y = x.clone()
    y[1, 5] = 7e4  # one outlier per tensor/block row
    out["outlier"] = y
    z = x.clone()
    z[:, :32] = 0.0  # all-zero blocks (every block layout here is <= 32 wide or covers it)
    z[: min(rows, 16)] = 0.0
    out["zero_blocks"] = z
    out["subnormal"] = torch.randn(rows, cols, generator=g) * 2.0**-133
    # The deepest fp32 subnormals (0, ±1..3 × 2**-149): a block amax / 6 underflows to 0 (a trained
    # model's gradients have such blocks: fp4_block once divided by that 0 scale).
    out["min_subnormal"] = torch.randint(-3, 4, (rows, cols), generator=g).float() * 2.0**-149
    mid = torch.tensor([1.0625, 1.1875, 0.75, 1.25, 2.5, 5.0, 0.25, 3.5])  # E4M3 and E2M1 ties
    out["midpoints"] = mid[torch.randint(0, 8, (rows, cols), generator=g)] * torch.randint(
        -4, 5, (1, cols), generator=g).exp2()
    out["past_max"] = x * 1e5
    n = x.clone()
    n[2, 3], n[rows - 1, cols - 1], n[3, 17] = float("nan"), float("inf"), -float("inf")
    out["nan_inf"] = n
    out["bf16"] = x.to(torch.bfloat16).float()  # quantize() converts bf16 to fp32 before the math
    out["all_zero"] = torch.zeros(rows, cols)  # a tensor amax of +0 (a masked-out gradient)
    return out
