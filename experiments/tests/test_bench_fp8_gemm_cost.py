"""The FP8 GEMM cost model (experiments/bench/fp8_gemm_cost.py) counts what the code does."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason='the model stubs the Triton launch of kernel_calls (pip install -e ".[kernels]")')
# Before snip_kernels.quantize is first imported in this process (tests/unit/test_kernels.py needs the
# interpreter mode, and triton.jit reads it at import); the launch is stubbed here anyway.
os.environ.setdefault("TRITON_INTERPRET", "1")

from experiments.bench import fp8_gemm_cost as cost


def test_after_moves_fewer_bytes_and_keeps_w_off_the_micro_batch():
    t, n, k, m = 256, 512, 384, 4
    for fmt in ("fp8", "fp8_block"):
        for gemm in ("fprop", "dgrad"):
            before = cost._gemm_launches(gemm, fmt, t, n, k, m, after=False)
            after = cost._gemm_launches(gemm, fmt, t, n, k, m, after=True)
            assert sum(x.share * x.bytes for x in after) < sum(x.bytes for x in before), (fmt, gemm)
            assert not any(x.name == "aten._to_copy" and x.bytes > t * n for x in after)  # no fp32 output cast
            w_quantize = [x for x in after if x.name.startswith("triton quantize (W")]
            assert all(x.share == 1 / m for x in w_quantize) and len(w_quantize) == (gemm == "fprop")
        gemm_out = [x for x in cost._gemm_launches("fprop", fmt, t, n, k, m, after=True) if x.flops]
        assert len(gemm_out) == 1 and gemm_out[0].flops == 2 * t * k * n
    full = [x.name for x in cost._gemm_launches("fprop", "fp8", t, n, k, m, after=True) if x.bytes >= t * k]
    assert "aten.aminmax" in full and "aten.abs" not in full  # the amax: one pass, no |x| temporary


def test_the_report_prints(capsys):
    cost.main(["--tokens", "256", "--n", "512", "--k", "384", "--micro-batches", "2"])
    out = capsys.readouterr().out
    assert "fprop+dgrad+wgrad fp8        after" in out and torch.__version__
