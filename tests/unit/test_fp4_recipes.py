"""fp4_block (the SNIP paper's FP4) and the FP4 recipe switches (+/-sr, +/-rht).

fp4_block is checked element for element against ml_dtypes' E2M1 with the scale computed
by hand (FP32 block amax / 6); the generic block-scaling edge cases (all-zero blocks, NaN/Inf,
outliers, subnormals, layouts, compiled == eager) run for it in test_quantize.py, which
iterates over every base format. Each recipe switch is checked against an explicit
construction that does not go through the switch: "-sr" against round-to-nearest-even,
"+sr" for unbiasedness, "+rht"/"-rht" against an explicit Hadamard transform (or none).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.precision.formats import FORMATS, FP4_FORMATS, Operand, get_format
from megatron_snip.precision.gemm import quant_linear
from megatron_snip.precision.plan import GemmPrecision, PrecisionPlan, all_gemm_ids
from megatron_snip.precision.quantize import quantize
from megatron_snip.precision.quantize.hadamard import hadamard_transform
from megatron_snip.telemetry.plots import plot_precision_map

NUMEL = {"qkv": 3, "proj": 1, "fc1": 4, "fc2": 2}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na].contiguous().view(torch.int32),
                                               b[~nb].contiguous().view(torch.int32))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp4_block_reference(x: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Hand-written fp4_block: per (br, bc) block s = fl32(amax / 6), q = E2M1(fl32(x / s)), x' = fl32(q * s)."""
    rows, cols = x.shape
    br, bc = block
    out = np.empty_like(x)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            b = x[i:i + br, j:j + bc]
            amax = np.float32(np.abs(b).max())
            s = np.float32(1.0) if amax == 0 else np.float32(amax / np.float32(6.0))
            q = (b / s).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
            out[i:i + br, j:j + bc] = (q * s).astype(np.float32)
    return out


def test_fp4_block_is_the_paper_layout_and_counts_as_fp4():
    f = get_format("fp4_block")
    assert f.element.name == "e2m1" and f.is_fp4 and "fp4_block" in FP4_FORMATS
    assert f.block_for(Operand.ACTIVATION) == (1, 128) and f.block_for(Operand.GRADIENT) == (1, 128)
    assert f.block_for(Operand.WEIGHT) == (128, 128)
    assert f.stochastic_for(Operand.GRADIENT) and not f.stochastic_for(Operand.ACTIVATION)
    assert not f.wgrad_hadamard and not f.uses_tensor_amax  # block-local scales: TP shards agree by layout


@pytest.mark.parametrize("operand,fmt", [(Operand.ACTIVATION, "fp4_block"), (Operand.WEIGHT, "fp4_block"),
                                         (Operand.GRADIENT, "fp4_block-sr")])
def test_fp4_block_matches_ml_dtypes(operand, fmt):
    g = gen(0)
    x = torch.randn(256, 384, generator=g)
    # very different block magnitudes, a zero block, exact midpoints and subnormal-scale blocks
    x *= torch.exp2(torch.randint(-30, 30, (2, 1, 3, 1), generator=g).float()).repeat_interleave(128, 0) \
        .reshape(256, 1, 3, 1).expand(256, 1, 3, 128).reshape(256, 384)
    x[:128, 128:256] = 0
    x[200, :128] = torch.tensor([6.0, 2.5, 0.75, -1.25] * 32)  # amax 6 -> s = 1: E2M1 midpoints
    x[130:140, 256:] *= 1e-38
    spec = get_format(fmt)
    want = fp4_block_reference(x.numpy(), spec.block_for(operand))
    got = quantize(x, fmt, operand)
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))


def test_fp4_block_gradients_round_stochastically_and_unbiased():
    vals = torch.tensor([0.1, 0.3, 0.8, 1.1, 1.7, 2.2, 2.9, 3.3, 4.6, 6.0] * 12 + [0.0] * 8)  # 128 values
    x = vals.repeat(4000, 1)  # one 1x128 tile per row, amax 6 -> scale 1: the grid is E2M1 itself
    y = quantize(x, "fp4_block", Operand.GRADIENT, generator=gen(1))
    assert torch.equal(y, quantize(x, "fp4_block", Operand.GRADIENT, generator=gen(1)))  # the generator decides
    assert not torch.equal(y, quantize(x, "fp4_block", Operand.GRADIENT, generator=gen(2)))
    # each draw is one of the two neighbours; the mean is unbiased (std error <= 1/sqrt(n))
    assert set(y[:, 4].unique().tolist()) == {1.5, 2.0}
    assert torch.all((y.mean(0) - x[0]).abs() < 5 / math.sqrt(x.shape[0]))


@pytest.mark.parametrize("name,sr,rht", [("nvfp4", True, True), ("nvfp4-sr", False, True), ("nvfp4-rht", True, False),
                                         ("nvfp4-sr-rht", False, False), ("mxfp4+sr", True, False),
                                         ("mxfp4+rht", False, True), ("mxfp4+sr+rht", True, True),
                                         ("fp4_block-sr", False, False), ("fp4_block+rht", True, True)])
def test_recipe_switch_names(name, sr, rht):
    f = get_format(name)
    assert (f.stochastic_gradients, f.wgrad_hadamard, f.name) == (sr, rht, name)
    assert name in FORMATS and name in FP4_FORMATS
    base = get_format(name.split("+")[0].split("-")[0])
    assert (f.block, f.weight_block, f.scaling, f.element) == (base.block, base.weight_block, base.scaling, base.element)


@pytest.mark.parametrize("name,match", [("nvfp4+sr", "already uses stochastic rounding.*drop \\+sr"),
                                        ("mxfp4-rht", "does not use the wgrad RHT.*drop -rht"),
                                        ("mxfp4+rht+sr", "sr before rht"), ("nvfp4-sr-sr", "each switch once"),
                                        ("fp8+sr", "apply to the FP4 formats"), ("mxfp4+fast", "unknown precision"),
                                        ("fp6", "unknown precision format 'fp6'")])
def test_bad_recipe_names_say_why(name, match):
    with pytest.raises(ValueError, match=match):
        get_format(name)
    assert name not in FORMATS and name not in FP4_FORMATS
    assert list(FORMATS) == ["bf16", "fp8", "fp8_block", "mxfp8", "nvfp4", "mxfp4", "fp4_block"]  # base formats only


@pytest.mark.parametrize("base", ["nvfp4", "fp4_block"])
def test_without_sr_gradients_round_to_nearest(base):
    # Gradients and activations share element grid and 1-D blocks in these formats, so "-sr" gradients
    # must equal the (always RNE) activation quantization bit for bit.
    g = torch.randn(64, 256, generator=gen(3))
    assert bits_equal(quantize(g, f"{base}-sr", Operand.GRADIENT, generator=gen(4)),
                      quantize(g, base, Operand.ACTIVATION))


def test_mxfp4_with_sr_is_stochastic_and_unbiased():
    x = (torch.rand(1, 32, generator=gen(5)) * 5.0).repeat(4000, 1)
    x[:, 0] = 6.0  # scale 2**0: the grid is E2M1
    y = quantize(x, "mxfp4+sr", Operand.GRADIENT, generator=gen(6))
    assert bits_equal(quantize(x, "mxfp4", Operand.GRADIENT, generator=gen(6)), quantize(x, "mxfp4", Operand.ACTIVATION))
    assert not torch.equal(y[0], y[1]) or not torch.equal(y[1], y[2])
    assert torch.all((y.mean(0) - x[0]).abs() < 5 / math.sqrt(x.shape[0]))


@pytest.mark.parametrize("variant,base,rht", [("mxfp4+rht", "mxfp4", True), ("nvfp4-rht", "nvfp4", False),
                                              ("mxfp4+sr+rht", "mxfp4+sr", True)])
def test_rht_switch_sets_the_wgrad_transform(variant, base, rht):
    # quant_linear's wgrad in the variant == the base format's quantizer on explicitly (un)rotated operands.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 64, generator=g)
    w = (torch.randn(32, 64, generator=g) * 0.1).requires_grad_(True)
    dy = torch.randn(128, 32, generator=g)
    quant_linear(x, w, GemmPrecision(wgrad=variant), generator=gen(9)).backward(dy)
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    if rht:
        dyt, xt = hadamard_transform(dyt), hadamard_transform(xt)
    q = torch.Generator().manual_seed(9)  # the same draw order as gemm.py: dYᵀ first
    want = quantize(dyt, base, Operand.GRADIENT, generator=q) @ quantize(xt, base, Operand.ACTIVATION, generator=q).t()
    assert bits_equal(w.grad, want)


def test_plans_count_fp4_block_and_variants_as_fp4_and_round_trip(tmp_path):
    for fmt in ("fp4_block", "nvfp4-sr", "mxfp4+sr+rht"):
        plan = PrecisionPlan.uniform(fmt, 2, NUMEL)
        assert plan.fp4_flops_share == 1.0
        path = tmp_path / f"{fmt}.json"
        path.write_text(plan.to_json())
        assert PrecisionPlan.load(path).hash == plan.hash
    mixed = {g: ("fp4_block" if g.linear == "fc1" else "fp8_block") for g in all_gemm_ids(2)}
    assert PrecisionPlan.create(mixed, NUMEL).fp4_flops_share == pytest.approx(0.4)
    png = plot_precision_map(PrecisionPlan.create({g: ("nvfp4-sr" if g.layer else "fp4_block") for g in mixed}, NUMEL),
                             tmp_path / "map.png")
    assert png.stat().st_size > 0


def test_config_takes_the_paper_candidates_and_names_a_bad_switch():
    cfg = load_config("launch/configs/tiny.toml", ["snip.formats=['fp8_block','fp4_block']"])
    assert cfg.snip.formats == ("fp8_block", "fp4_block") or list(cfg.snip.formats) == ["fp8_block", "fp4_block"]
    load_config("launch/configs/tiny.toml", ["snip.formats=['fp8','mxfp4+sr+rht']"]).validate(1)
    with pytest.raises(ValueError, match="snip.formats"):
        load_config("launch/configs/tiny.toml", ["snip.formats=['fp8','nvfp4+sr']"]).validate(1)
