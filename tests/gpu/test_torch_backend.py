"""The torch backend on CUDA: real FP8 scaled-mm GEMMs vs the emulated reference (needs a CUDA GPU
with FP8 tensor cores; skipped elsewhere, e.g. every CPU CI run, with the reason).

Tolerance: the operands are the reference quantization bit for bit (checked), so the GEMMs
differ only by cuBLAS's fp32 accumulation order and the rounding of the two decode scales'
product: relative 1e-5 of the output norm.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.precision.backends import get_backend
from megatron_snip.precision.backends.scaled_mm import OPERAND_PAIRS, scaled_mm_support
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.quantize import quantize
from megatron_snip.precision.quantize.scaled import SCALED_FORMATS, dequantize, quantize_scaled

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_scaled_mm_linear_close_to_emulated(fmt):
    support = [scaled_mm_support(fmt, "cuda", a, b) for a, b in OPERAND_PAIRS]
    if not all(ok for ok, _ in support):
        pytest.skip(f"{fmt} scaled-mm unsupported here: {[r for ok, r in support if not ok]}")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", generator=g)
    w = torch.nn.Parameter(torch.randn(768, 1024, device="cuda", generator=g) / 32)
    dy = torch.randn(512, 768, device="cuda", generator=g)
    assert torch.equal(dequantize(quantize_scaled(x, fmt, "activation")), quantize(x, fmt, "activation"))
    outs = {}
    for name in ("torch", "emulated"):
        xx = x.clone().requires_grad_(True)
        w.grad = None
        be = get_backend(name)
        y = be.linear(xx, w, GemmPrecision.uniform(fmt))
        y.backward(dy)
        outs[name] = (y.detach(), xx.grad, w.grad.clone())
        if name == "torch":
            assert be.fallbacks == {}, be.fallbacks
    for i in range(3):
        got, want = outs["torch"][i], outs["emulated"][i]
        assert ((got - want).norm() / want.norm()).item() < 1e-5, (fmt, i)
