"""Transformer Engine backend vs the emulated reference (needs CUDA + transformer_engine).

Skipped on machines without them (every CPU CI run). Tolerances: TE quantizes
with its own kernels (scale arithmetic, RHT/SR RNG), so it agrees with the
emulated reference statistically, not bitwise: we compare both against the
unquantized product and require similar relative errors.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.precision.backends import get_backend
from megatron_snip.precision.backends.support import check
from megatron_snip.precision.plan import GemmPrecision

pytestmark = pytest.mark.skipif(
    not check("te", "bf16"),
    reason=f"needs CUDA and transformer_engine: {check('te', 'bf16').reason}",
)

# expected relative error of one GEMM's output vs fp32, generous bounds for both backends
REL_ERR = {"fp8": 0.08, "fp8_block": 0.06, "mxfp8": 0.06, "nvfp4": 0.25}
# (T, K, N) of every case here: multiples of every format's blocks and of 16.
TKN = (256, 512, 384)
# The dtype each format's linear computes in (the te backend's rule, ``te.input_dtype_error``):
# nvfp4 needs bf16 inputs (TE's RHT), so it runs under bf16 autocast, as training on CUDA does;
# the others in fp32. tests/unit/test_gpu_shapes.py checks these against the rule on CPU.
INPUT_DTYPE = {"fp8": torch.float32, "fp8_block": torch.float32, "mxfp8": torch.float32, "nvfp4": torch.bfloat16}
KEPT_WEIGHT_DTYPE = torch.bfloat16  # the per-step weight test runs under bf16 autocast
KEPT_WEIGHT_FORMATS = ("fp8", "mxfp8", "nvfp4")


def _autocast(dtype: torch.dtype):
    return torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32)


@pytest.mark.parametrize("fmt", list(REL_ERR))
def test_te_linear_close_to_emulated(fmt):
    if not check("te", fmt, "cuda"):
        pytest.skip(check("te", fmt, "cuda").reason)
    torch.manual_seed(0)
    t, k, n = TKN
    x = torch.randn(t, k, device="cuda", requires_grad=True)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda") / k**0.5)
    dy = torch.randn(t, n, device="cuda")
    exact = x.detach() @ w.detach().t()
    p = GemmPrecision.uniform(fmt)
    outs = {}
    for name in ("te", "emulated"):
        x.grad = w.grad = None
        with _autocast(INPUT_DTYPE[fmt]):
            y = get_backend(name).linear(x, w, p)
        y.backward(dy.to(y.dtype))
        outs[name] = (y.detach().float(), x.grad.clone(), w.grad.clone())
    for name, (y, dx, dw) in outs.items():
        rel = ((y - exact).norm() / exact.norm()).item()
        assert rel < REL_ERR[fmt], (name, fmt, rel)
    te_y, em_y = outs["te"][0], outs["emulated"][0]
    assert ((te_y - em_y).norm() / exact.norm()).item() < 2 * REL_ERR[fmt]
    for i in (1, 2):  # gradients: same direction
        cos = torch.nn.functional.cosine_similarity(outs["te"][i].flatten(), outs["emulated"][i].flatten(), dim=0)
        assert cos > 0.95, (fmt, i, cos.item())


@pytest.mark.parametrize("fmt", KEPT_WEIGHT_FORMATS)
def test_te_weight_kept_per_step_equals_fresh_quantization(fmt):
    """is_first_microbatch from the step scope: the kept quantized weight gives the bits of
    quantizing afresh at every micro-batch, and a weight changed between steps is re-quantized
    (a stale kept weight would give the previous step's output)."""
    if not check("te", fmt, "cuda"):
        pytest.skip(check("te", fmt, "cuda").reason)
    from megatron_snip.model.layers import PrecisionLinear

    torch.manual_seed(0)
    t, k, n = TKN
    lin = PrecisionLinear(k, n, layer=0, linear="qkv", init_std=0.02).cuda()
    lin.backend = get_backend("te")
    lin.set_precision(GemmPrecision.uniform(fmt))
    xs = [torch.randn(t, k, device="cuda") for _ in range(2)]
    for _step in range(2):
        with _autocast(KEPT_WEIGHT_DTYPE):
            lin.weight_copy.open()
            kept = [lin(x) for x in xs]
            lin.weight_copy.close()
            fresh = [lin.backend.linear(x, lin.weight, lin.precision, is_first_microbatch=None) for x in xs]
        for a, b in zip(kept, fresh):
            assert torch.equal(a, b)
        with torch.no_grad():
            lin.weight.mul_(1.5)
