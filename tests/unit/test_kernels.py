"""Triton quantize kernels (snip_kernels/quantize.py) vs the reference quantizers, bit for bit, under the
Triton interpreter on CPU (TRITON_INTERPRET=1, numpy semantics: what a GPU computes for the
exact operations the kernels restrict themselves to; scripts/gpu_check.sh repeats this on CUDA).

Input classes are the reference tests' (tests/unit/test_quantize.py): scaled Gaussians, a
single outlier, all-zero blocks, subnormals, E4M3/E2M1 midpoints, values past the element
max, NaN and Inf, bf16 inputs; every format, operand kind (weights with 2-D blocks, gradients
with stochastic rounding), both layouts, with and without the wgrad Hadamard transform and
with a TP-reduced amax. Tensors stay small: the interpreter runs a tile at a time in numpy.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if "snip_kernels.quantize" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("snip_kernels.quantize was imported for a GPU in this process; run this file alone on CPU",
                allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip('triton is not installed (pip install -e ".[kernels]")', allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before snip_kernels.quantize is imported: triton.jit reads it then

from megatron_snip.precision.formats import FORMATS, Operand, get_format
from megatron_snip.precision.quantize.blocks import _qdq
from megatron_snip.precision.quantize.kernel_calls import qdq
from megatron_snip.precision.quantize.noise import draw_seeds
from snip_kernels.cases import input_classes

LOW_PRECISION = [f for f in FORMATS if f != "bf16"]
# numpy's warnings for the IEEE overflows and divisions by zero the kernels rely on (Inf -> saturation)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na].contiguous().view(torch.int32), b[~nb].contiguous().view(torch.int32))


def _check(fmt: str, operand: Operand, rows: int, cols: int, hadamard: bool, classes=None) -> None:
    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(1)
    for name, x in input_classes(rows, cols).items():
        if classes and name not in classes:
            continue
        for colwise in (False, True):
            p = x.t().contiguous() if colwise else x
            seeds = draw_seeds(gen, "cpu") if spec.stochastic_for(operand) else None
            want = _qdq(p, spec, operand, hadamard, colwise, None, seeds)
            got = qdq(p, spec, operand, hadamard, colwise, None, seeds)
            assert bits_equal(got, want), (fmt, operand.value, name, hadamard, colwise,
                                           int((got.view(torch.int32) != want.view(torch.int32)).sum()))


@pytest.mark.parametrize("fmt", LOW_PRECISION)
@pytest.mark.parametrize("operand", [Operand.ACTIVATION, Operand.GRADIENT])
def test_1d_blocks_and_tensor_scaling_match_reference(fmt, operand):
    _check(fmt, operand, 24, 256, hadamard=False)  # 24 rows: a partial row tile is masked


@pytest.mark.parametrize("fmt", LOW_PRECISION)
def test_weights_match_reference(fmt):
    big = get_format(fmt).weight_block == (128, 128)  # fp8_block, fp4_block: one full block row
    _check(fmt, Operand.WEIGHT, 128 if big else 32, 128, hadamard=False,
           classes=("gaussian", "zero_blocks", "nan_inf", "midpoints") if big else None)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8", "bf16", "mxfp4+sr+rht", "fp4_block+rht"])
def test_wgrad_hadamard_matches_reference(fmt):
    # nvfp4 rotates inside its 16-blocks; the others rotate in a pass of their own first
    _check(fmt, Operand.GRADIENT, 16, 128, hadamard=True, classes=("gaussian", "nan_inf", "midpoints"))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_given_tensor_amax_matches_reference(fmt):
    x = input_classes(16, 64)["gaussian"]
    spec = get_format(fmt)
    amax = x.abs().amax() * 3  # the unsharded tensor's amax, larger than this shard's
    for h in (False, True):
        for operand in (Operand.ACTIVATION, Operand.GRADIENT):
            seeds = draw_seeds(torch.Generator().manual_seed(2), "cpu") if spec.stochastic_for(operand) else None
            assert bits_equal(qdq(x, spec, operand, h, False, amax, seeds), _qdq(x, spec, operand, h, False, amax, seeds))


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block"])
@pytest.mark.parametrize("operand", list(Operand))
def test_scaled_operands_match_reference(fmt, operand):
    # The torch backend's operands: float8 elements (row-major, whatever the input layout)
    # and decode scales, as quantize.blocks.scaled_elements computes them.
    from megatron_snip.precision.quantize import quantize
    from megatron_snip.precision.quantize.blocks import scaled_elements
    from megatron_snip.precision.quantize.kernel_calls import scaled_operand
    from megatron_snip.precision.quantize.scaled import ScaledOperand, dequantize

    spec = get_format(fmt)
    rows = 128 if operand is Operand.WEIGHT and fmt == "fp8_block" else 24
    classes = input_classes(rows, 256)
    for name, x in classes.items():
        if rows == 128 and name not in ("gaussian", "zero_blocks", "nan_inf"):
            continue
        for view in (x, x.t().contiguous().t(), x.to(torch.bfloat16) if name == "bf16" else x):
            elements, scale = scaled_operand(view, spec, operand, None)
            want_e, want_s = scaled_elements(view.float().contiguous(), spec, operand, None)
            assert elements.is_contiguous() and bits_equal(scale, want_s), (fmt, operand.value, name)
            if name != "nan_inf":  # the interpreter's float8 cast maps NaN to -max (a GPU keeps NaN)
                assert torch.equal(elements.float(), want_e), (fmt, operand.value, name)
            assert bits_equal(dequantize(ScaledOperand(elements, scale)), quantize(view, fmt, operand))


# --- issue #34 item 3: one read, one write; the rotation fused; bf16 read as it is ---------------------
@pytest.mark.parametrize("fmt,hadamard", [("fp8", False), ("nvfp4", True), ("mxfp4+rht", True), ("fp8_block", False)])
def test_bf16_input_is_read_as_bf16(fmt, hadamard):
    spec = get_format(fmt)
    x = input_classes(16, 128)["gaussian"].to(torch.bfloat16)
    for colwise in (False, True):
        p = x.t().contiguous() if colwise else x
        want = _qdq(p.float(), spec, Operand.GRADIENT, hadamard, colwise, None, None)
        assert bits_equal(qdq(p, spec, Operand.GRADIENT, hadamard, colwise, None, None), want), (fmt, colwise)


def test_rotated_amax_is_the_rotated_operands_amax():
    from megatron_snip.precision.quantize.kernel_calls import rotated_amax

    for name, x in input_classes(24, 256).items():
        for colwise in (False, True):
            p = x.t().contiguous() if colwise else x
            want = _qdq(p, get_format("bf16"), Operand.GRADIENT, True, colwise, None, None).abs().amax()
            assert bits_equal(rotated_amax(p, colwise).reshape(1), want.reshape(1)), (name, colwise)


def _launches(monkeypatch):
    from megatron_snip.precision.quantize import kernel_calls

    seen = []
    real = kernel_calls.launch_qdq

    def record(*args, **kw):
        seen.append((kw["scaling"], kw["hadamard"]))
        return real(*args, **kw)

    monkeypatch.setattr(kernel_calls, "launch_qdq", record)
    return seen


@pytest.mark.parametrize("fmt,launches", [
    ("nvfp4", [(6, True), (4, True)]),  # the rotated amax (read only), then quantize rotating in-tile
    ("mxfp4+rht", [(3, True)]),  # 32-blocks: rotated in-tile too (was a separate rotation pass)
    ("fp4_block+rht", [(5, True)]),
])
def test_the_rotation_is_fused_into_the_quantize_kernel(monkeypatch, fmt, launches):
    seen = _launches(monkeypatch)
    x = input_classes(16, 128)["gaussian"]
    qdq(x, get_format(fmt), Operand.GRADIENT, True, False, None, draw_seeds(torch.Generator(), "cpu")
        if get_format(fmt).stochastic_for(Operand.GRADIENT) else None)
    assert seen == launches  # no scaling-0 (rotation-only) pass writing the rotated tensor out


def test_weight_tiles_get_enough_warps_not_to_spill():
    from snip_kernels.quantize import num_warps_for

    assert num_warps_for(128, 1, 128) == 16  # fp8_block / fp4_block 128x128 weight tiles: 32 fp32 per thread
    assert num_warps_for(16, 1, 128) == 4 and num_warps_for(16, 8, 16) == 4  # 2K-element tiles: the default


def test_quantize_hands_bf16_to_the_kernel_without_an_fp32_copy(monkeypatch):
    import megatron_snip.precision.quantize as q

    seen = []
    monkeypatch.setattr(q, "_kernel_path", lambda p: True)
    monkeypatch.setattr(q, "_run_qdq", lambda p, *a: seen.append(p) or p.float())
    x = torch.randn(32, 128).to(torch.bfloat16)
    for view in (x, x.t().contiguous().t()):
        q.quantize(view, "mxfp8", Operand.ACTIVATION)
        assert seen[-1].dtype == torch.bfloat16 and seen[-1].data_ptr() == view.data_ptr()
