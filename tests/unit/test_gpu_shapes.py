"""Every shape and dtype the GPU tests and ``gpu_check`` use passes the rules the device applies (#34).

A GPU test whose shape the project's own rules send to the emulated path, or whose dtype the te
backend refuses, fails on a correct GPU (the old torch fp8_block case had N = 768: dgrad reads
768/128 = 6 weight blocks along its reduction, not a multiple of 4, so it ran emulated and
``assert be.fallbacks == {}`` failed; the old TE nvfp4 case fed fp32, which the te backend
refuses). Here, on CPU, each case goes through the same functions the device path calls:
``scaled_mm_shape_error`` with a CUDA device (its rules need no GPU), ``operand_shape_error`` (the
block rules), ``te.input_dtype_error`` and ``te.setting_problems`` (the TE dtype and start-up rules).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.model.shapes import model_linear_shapes
from megatron_snip.precision.backends.scaled_mm import SCALED_FORMATS
from megatron_snip.precision.backends.te import input_dtype_error, setting_problems
from megatron_snip.precision.formats import get_format
from megatron_snip.precision.gemm_shapes import GEMM_OPERANDS, gemm_shape_error
from megatron_snip.precision.scaled_mm_rules import scaled_mm_expected_on, scaled_mm_shape_error
from megatron_snip.training.resolve import resolve_autocast_dtype

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")  # a device object only: the rules as CUDA applies them, no GPU needed
HOPPER = ((9, 0), "12.9")  # H100/H200 with a torch built for CUDA >= 12.9: fp8 and fp8_block expected


def _module(rel: str):
    """Import a tests/gpu or scripts file by path (scripts/ on sys.path, as when run)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(Path(rel).stem + "_shapes_under_test", ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scaled_mm_problems(fmt: str, t: int, k: int, n: int, padded_scales: bool = False) -> list[str]:
    """Why any GEMM of a linear with weight (N, K) on T tokens would not run as scaled-mm on CUDA in ``fmt``.

    ``padded_scales=False`` (the default): on a torch without the padded-scale API
    (``padded_scale_api``), the strictest device - a GPU test's shape must run natively on every
    torch the project supports, not only where ``F.scaled_mm`` takes padded 128x128 scales."""
    dims = {"T": t, "K": k, "N": n}
    problems = []
    for gemm, ((_, a_kind, (ar, ac)), (_, b_kind, (br, bc))) in GEMM_OPERANDS.items():
        a_shape, b_shape = (dims[ar], dims[ac]), (dims[br], dims[bc])
        blocks = gemm_shape_error(fmt, gemm, n, k, t)
        mm = scaled_mm_shape_error(fmt, a_shape, a_kind, b_shape, b_kind, CUDA, padded_scales=padded_scales)
        problems += [f"{gemm}: {e}" for e in (blocks, mm) if e]
    return problems


def expected_on_hopper(fmt: str) -> bool:
    return scaled_mm_expected_on(fmt, *HOPPER)[0]


def test_the_rules_refuse_the_old_cases():
    """The check below can fail: the old torch fp8_block shape and the old TE nvfp4 dtype are refused."""
    old = scaled_mm_problems("fp8_block", 512, 1024, 768)
    assert len(old) == 1 and old[0].startswith("dgrad:") and "K/128 to be a multiple of 4" in old[0], old
    # where torch has the padded-scale API the old dgrad runs through it instead (issue #34 item 2)
    assert scaled_mm_problems("fp8_block", 512, 1024, 768, padded_scales=True) == []
    assert input_dtype_error("nvfp4", torch.float32) is not None
    assert setting_problems(["nvfp4"], tp_size=1, tp_amax="tensor", per_gemm_replans=False,
                            activation_dtype=torch.float32)


def test_torch_backend_gpu_test_runs_every_gemm_as_scaled_mm():
    t, k, n = _module("tests/gpu/test_torch_backend.py").TKN
    assert len({t, k, n}) == 3  # a transposed scale tensor cannot pass for the right one
    for fmt in SCALED_FORMATS:
        assert expected_on_hopper(fmt)
        assert scaled_mm_problems(fmt, t, k, n) == [], fmt


def test_te_backend_gpu_test_meets_the_te_rules():
    mod = _module("tests/gpu/test_te_backend.py")
    t, k, n = mod.TKN
    assert set(mod.INPUT_DTYPE) == set(mod.REL_ERR)
    for fmt, dtype in mod.INPUT_DTYPE.items():
        assert input_dtype_error(fmt, dtype) is None, fmt
        for gemm in GEMM_OPERANDS:
            assert gemm_shape_error(fmt, gemm, n, k, t) is None, (fmt, gemm)
        assert t % 16 == k % 16 == n % 16 == 0  # TE's FP8 GEMMs: every dim a multiple of 16
    for fmt in mod.KEPT_WEIGHT_FORMATS:
        assert input_dtype_error(fmt, mod.KEPT_WEIGHT_DTYPE) is None, fmt


@pytest.mark.parametrize("arch", ["blackwell", "hopper"])
def test_te_snip_gpu_test_starts_and_fits(arch, tmp_path):
    mod = _module("tests/gpu/test_te_snip.py")
    formats, rho = mod.CANDIDATES[arch]
    cfg = load_config(ROOT / "launch/configs/tiny.toml", mod.overrides(formats, rho, tmp_path))
    dtype = resolve_autocast_dtype(cfg.training.dtype, CUDA) or torch.float32  # what the trainer runs on CUDA
    run_formats = set(formats) | {"bf16"}
    assert setting_problems(run_formats, tp_size=cfg.parallel.tp, tp_amax=cfg.precision.tp_amax,
                            per_gemm_replans=cfg.snip.granularity == "gemm", activation_dtype=dtype) == []
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    for name, (n, k) in model_linear_shapes(cfg.model).items():
        for fmt in run_formats:
            for gemm in GEMM_OPERANDS:
                assert gemm_shape_error(fmt, gemm, n, k, tokens) is None, (name, fmt, gemm)


@pytest.mark.parametrize("smoke", [False, True])
def test_gpu_check_shapes_run_as_scaled_mm(smoke, tmp_path):
    """gpu_check's gemm check, its step stack (fp8 through the torch backend) and tiny_snip's model:
    every GEMM a format expected on Hopper runs as scaled-mm, so a fallback there means a defect."""
    check = _module("scripts/gpu_check.py")
    runs = _module("scripts/gpu_check_runs.py")
    for fmt in SCALED_FORMATS:
        assert scaled_mm_problems(fmt, *check.GEMM_TKN[smoke]) == [], fmt
    cfg = load_config(ROOT / "launch/configs/llama_1b.toml", runs.STACK_OVERRIDES[smoke])
    b, s = runs.STACK_BATCH[smoke]
    for name, (n, k) in model_linear_shapes(cfg.model).items():
        assert scaled_mm_problems("fp8", b * s, k, n) == [], name  # the fp8 and mixed plans
    tiny = load_config(ROOT / "launch/configs/tiny.toml", runs.tiny_snip_overrides(str(tmp_path), CUDA, smoke))
    tokens = tiny.training.micro_batch_size * tiny.training.seq_len
    for name, (n, k) in model_linear_shapes(tiny.model).items():
        for fmt in set(tiny.snip.formats) & set(SCALED_FORMATS):
            assert scaled_mm_problems(fmt, tokens, k, n) == [], (name, fmt)
        for fmt in tiny.snip.formats:  # every candidate fits its blocks (emulated ones too)
            for gemm in GEMM_OPERANDS:
                assert gemm_shape_error(fmt, gemm, n, k, tokens) is None, (name, fmt, gemm)
    assert get_format("fp8").name in tiny.snip.formats
