"""The reference quantizers divide by constants the same way on every device.

On CUDA, PyTorch computes ``t / c`` for a Python scalar (or a CPU 0-d tensor) ``c`` as
``t * fl32(1 / c)`` (its div_true kernel's CPU-scalar path), which differs from IEEE division
by one ulp for e.g. c = 6 (E2M1's max). CPU eager divides exactly, so a CPU run cannot see the
difference by itself: ``CudaScalarDivision`` models the CUDA rule on CPU, and the quantizers
must give the same bits under it as without it.
"""

from __future__ import annotations

import numbers

import torch
from torch.overrides import TorchFunctionMode

from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.quantize import quantize
from megatron_snip.precision.quantize.blocks import _qdq


def _cpu_scalar(v: object) -> bool:
    return isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu")


_DIVS = (torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.true_divide)


class CudaScalarDivision(TorchFunctionMode):
    """Floating-point ``a / b`` with a scalar ``b`` becomes ``a * fl(1 / b)`` (in a's dtype), as on CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _DIVS and len(args) == 2 and not kwargs and isinstance(args[0], torch.Tensor)
                and args[0].is_floating_point() and args[0].dim() > 0 and _cpu_scalar(args[1])):
            a, b = args
            inv = torch.tensor(1.0, dtype=a.dtype) / torch.tensor(float(b), dtype=a.dtype)  # opmath 1/b
            return a * inv
        return func(*args, **kwargs)


def test_the_model_is_one_ulp_off_where_cuda_is():
    x = torch.tensor([1.0, 5.0, 7.0, 11.0, 13.0])  # x / 6 != x * fl(1/6) for these (checked in fp32)
    with CudaScalarDivision():
        modelled = x / 6.0
    exact = torch.div(x, torch.full_like(x, 6.0))
    assert not torch.equal(modelled, exact)
    assert torch.equal(modelled, x * torch.tensor(1 / 6, dtype=torch.float32))


def test_fp4_block_scales_are_correctly_rounded_under_cuda_scalar_division():
    spec = get_format("fp4_block")
    g = torch.Generator().manual_seed(0)
    # block amaxes with many mantissas, so that amax / 6 and amax * fl(1/6) differ for some blocks
    x = torch.randn(256, 512, generator=g) * torch.rand(256, 4, generator=g).repeat_interleave(128, 1).mul(20).exp2()
    for operand in (Operand.ACTIVATION, Operand.WEIGHT):
        want = _qdq(x, spec, operand, False, False, None, None)
        with CudaScalarDivision():
            got = _qdq(x, spec, operand, False, False, None, None)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), operand
        # and the public entry point, rowwise and colwise
        with CudaScalarDivision():
            assert torch.equal(quantize(x.t().contiguous().t(), "fp4_block", operand), want)
