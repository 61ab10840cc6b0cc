"""SNIP's error GEMMs in BF16 where that is exact (``snip/measure.error_gemm``), tested on CPU.

On CUDA a ``bf16_exact`` format's GEMM runs as a BF16 tensor-core GEMM with fp32 accumulation
(``bf16_mm``); that is exact because every dequantized operand value is a BF16 value (power-of-two
scale x an element of <= 8 significant bits) and every product of two fits fp32. CPU checks: the
premise on every such format and operand kind, over inputs spanning 2^±40 (and zeros, a single
outlier per block); that the other formats are not claimed; that BF16 products accumulated in
fp32 (float64 products rounded once, as exact products are) equal the fp32 reference GEMM of the
same operands in the order-independent sense; that ``bf16_mm``'s call is valid against the meta
registration (dtype, shape); and that on CPU ``error_gemm`` is bitwise the emulated reference.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.precision.formats import FORMATS, Operand
from megatron_snip.precision.gemm import emulated_gemm
from megatron_snip.precision.quantize import quantize
from megatron_snip.snip.measure import bf16_exact, bf16_mm, error_gemm

EXACT = ("fp8_block", "mxfp8", "mxfp4")


def _operand(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-40, 40, (rows, 1), generator=gen).float())
    x[0, :7] = 0.0  # zeros in a block
    x[1, 3] *= 1e4  # one outlier in a block
    return x


def test_which_formats_are_bf16_exact():
    assert {f for f in FORMATS if bf16_exact(f)} == set(EXACT)  # fp8/nvfp4/fp4_block carry an fp32 scale


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("kind", list(Operand))
def test_dequantized_operands_are_bf16_values(fmt, kind):
    q = quantize(_operand(256, 256, 1), fmt, kind, generator=torch.Generator().manual_seed(2))
    assert torch.equal(q.to(torch.bfloat16).float(), q)


@pytest.mark.parametrize("fmt", EXACT)
def test_products_of_bf16_exact_operands_are_exact_in_fp32(fmt):
    """Each product of two BF16-exact operands is exact in fp32, so a BF16 GEMM accumulating in fp32 and the fp32 GEMM
    sum the same fp32 products: both equal the exact (fp64) sum within fp32 summation error,
    K * 2^-24 of sum |a_i b_i| (a deterministic bound, whatever the order)."""
    k = 256
    a = quantize(_operand(64, k, 3), fmt, Operand.ACTIVATION)
    b = quantize(_operand(128, k, 4), fmt, Operand.WEIGHT)  # 128 rows: fp8_block weights are 128x128 blocks
    products = a.double()[:, None, :] * b.double()[None, :, :]  # exact: 8+8 significant bits in fp64
    assert torch.equal(products.float().double(), products)  # ... and in fp32 (no rounding)
    exact = products.sum(-1)
    bound = k * 2.0**-24 * products.abs().sum(-1)
    assert ((a @ b.t()).double() - exact).abs().le(bound).all()


def test_bf16_mm_call_matches_the_meta_registration():
    out = bf16_mm(torch.empty(8, 64, device="meta"), torch.empty(16, 64, device="meta"))
    assert out.dtype == torch.float32 and out.shape == (8, 16) and out.device.type == "meta"
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction  # restored after the call


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "mxfp4", "nvfp4"])
def test_on_cpu_error_gemm_is_the_reference_bit_for_bit(fmt):
    a, b = _operand(32, 128, 5), _operand(128, 128, 6)  # fp8_block weights: 128x128 blocks
    kw = {"hadamard": False, "amax_reduce": None, "compiled": False}
    ref = emulated_gemm(fmt, a, Operand.GRADIENT, b, Operand.WEIGHT, generator=torch.Generator().manual_seed(7), **kw)
    got = error_gemm(fmt, a, Operand.GRADIENT, b, Operand.WEIGHT, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(got, ref)
