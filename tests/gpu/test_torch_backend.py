"""The torch backend on CUDA: real FP8 scaled-mm GEMMs vs the exact product of their operands (needs a
CUDA GPU with FP8 tensor cores; skipped elsewhere, e.g. every CPU CI run, with the reason).

Tolerance: the operands are the reference quantization bit for bit (checked), so the GEMMs differ
from the exact (fp64) product of the dequantized operands only by the tensor cores' accumulation:
``scaled_mm.accumulation_tolerance(K)`` = sqrt(K) * 2^-13 in units of |A|·|B|ᵀ (``gemm_error``;
Hopper's FP8 accumulation keeps ~14 bits). Where PyTorch documents a scaled-mm for a format on this
device (``scaled_mm_expected``), a fallback fails the test instead of skipping it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.precision.backends import get_backend
from megatron_snip.precision.backends.scaled_mm import (
    accumulation_tolerance,
    fast_accum_for,
    gemm_error,
    magnitude_ratio,
    scaled_mm_expected,
    scaled_mm_support,
)
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize import quantize
from megatron_snip.precision.quantize.scaled import SCALED_FORMATS, dequantize, quantize_scaled
from megatron_snip.precision.scaled_mm_rules import OPERAND_PAIRS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

# (T, K, N), all different (a transposed scale cannot pass for the right one). Every GEMM must run
# as scaled-mm on H100/H200 (``scaled_mm_shape_error``): reduction and output dims multiples of 16,
# and K/128 a multiple of 4 wherever a 128x128 weight block is read along K - fprop's K = 1024 and
# dgrad's N = 512 (the old N = 768 gave dgrad 6 blocks: emulated on a torch without the padded-scale
# API, and the fallback assert failed). So every GEMM runs natively on any supported torch;
# tests/unit/test_gpu_shapes.py runs these through the rules on CPU.
TKN = (384, 1024, 512)


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_scaled_mm_linear_matches_the_exact_product(fmt):
    support = [scaled_mm_support(fmt, "cuda", a, b) for a, b in OPERAND_PAIRS]
    expected, why = scaled_mm_expected(fmt, "cuda")
    if not all(ok for ok, _ in support):
        assert not expected, f"{fmt} scaled-mm is documented here but fell back: {[r for ok, r in support if not ok]}"
        pytest.skip(f"{fmt} scaled-mm not expected here: {why}")
    g = torch.Generator(device="cuda").manual_seed(0)
    t, k, n = TKN
    x = torch.randn(t, k, device="cuda", generator=g)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda", generator=g) / 32)
    dy = torch.randn(t, n, device="cuda", generator=g)
    assert torch.equal(dequantize(quantize_scaled(x, fmt, "activation")), quantize(x, fmt, "activation"))
    be = get_backend("torch")
    xx = x.clone().requires_grad_(True)
    y = be.linear(xx, w, GemmPrecision.uniform(fmt))
    y.backward(dy)
    assert be.fallbacks == {}, be.fallbacks
    gemms = {  # a·bᵀ as gemm.quant_linear forms each GEMM
        "fprop": (y, x, "activation", w.detach(), "weight"),
        "dgrad": (xx.grad, dy, "gradient", w.detach().t(), "weight"),
        "wgrad": (w.grad, dy.t(), "gradient", x.t(), "activation"),
    }
    for name, (got, a, a_kind, b, b_kind) in gemms.items():
        qa, qb = quantize(a, fmt, a_kind), quantize(b, fmt, b_kind)
        err = gemm_error(got, qa, qb)
        tol = accumulation_tolerance(a.shape[1], fast_accum_for(fmt, Operand(a_kind), Operand(b_kind)),
                                     magnitude_ratio(qa, qb))  # fp8 fprop accumulates fast (as TE)
        assert err <= tol, (fmt, name, err, tol)
