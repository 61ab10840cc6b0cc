"""``kernel_traffic``'s byte counts are the bytes each ``kernel_calls`` call really moves.

Counted, not assumed: every torch op the call runs outside the kernel is seen by a
``TorchDispatchMode`` (bytes of its tensor inputs read + tensor outputs written; allocations and
views move nothing), and every kernel launch adds what it reads (its input) and writes (its
output and block scales), under the Triton interpreter on CPU. Tensors of at most
``SMALL_TENSOR`` elements are left out on both sides, as the module says. So a change to a call
path (a fused amax, a fused rotation) that does not update its function fails here - and
``gpu_check``'s ``kernel_bw`` gate, which divides these bytes by the measured time, cannot be
off by a forgotten pass.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("TRITON_INTERPRET", "1")
kq = pytest.importorskip("megatron_snip.precision.quantize.kernel_calls", reason="needs Triton")

from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.quantize.kernel_traffic import (
    SMALL_TENSOR,
    qdq_traffic,
    scaled_operand_traffic,
)
from megatron_snip.precision.quantize.noise import draw_seeds

ROWS, COLS = 128, 256
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _nbytes(t: object) -> int:
    if isinstance(t, torch.Tensor) and t.numel() > SMALL_TENSOR:
        return t.numel() * t.element_size()
    return 0


class _Bytes(TorchDispatchMode):
    """Sums the bytes torch ops read and write (kernel launches are added by ``_count_launches``)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        is_view = any(r.alias_info is not None for r in schema.returns)
        if not self.paused and not is_view and func.overloadpacket.__name__ not in _NO_TRAFFIC:
            flat_in = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            flat_out = torch.utils._pytree.tree_leaves(out)
            self.total += sum(map(_nbytes, flat_in)) + sum(map(_nbytes, flat_out))
        return out


@pytest.fixture
def counter(monkeypatch):
    mode = _Bytes()
    launch = kq._launch

    def counted(x, y, scalars, seeds, scales_out, *rest, out_elements, **kw):
        # the kernel reads x once and writes y (and, for the scaled-mm operand, its block scales)
        mode.total += _nbytes(x) + _nbytes(y) + (_nbytes(scales_out) if out_elements else 0)
        mode.paused = True  # the interpreter's own tensor handling is not device traffic
        try:
            return launch(x, y, scalars, seeds, scales_out, *rest, out_elements=out_elements, **kw)
        finally:
            mode.paused = False

    monkeypatch.setattr(kq, "_launch", counted)
    return mode


CASES = [(fmt, operand, hadamard, amax_given)
         for fmt in ("fp8", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "fp4_block")
         for operand in (Operand.ACTIVATION, Operand.GRADIENT)
         for hadamard in ((False, True) if fmt == "nvfp4" and operand is Operand.GRADIENT else (False,))
         for amax_given in ((False, True) if get_format(fmt).uses_tensor_amax else (False,))]


@pytest.mark.parametrize(("fmt", "operand", "hadamard", "amax_given"), CASES,
                         ids=[f"{f}-{o.value}-h{int(h)}-a{int(a)}" for f, o, h, a in CASES])
def test_qdq_traffic_is_what_the_call_moves(counter, fmt, operand, hadamard, amax_given):
    spec = get_format(fmt)
    x = torch.randn(ROWS, COLS)
    seeds = draw_seeds(torch.Generator().manual_seed(0), "cpu") if spec.stochastic_for(operand) else None
    amax = x.abs().amax() if amax_given else None
    with counter:
        kq.qdq(x, spec, operand, hadamard, False, amax, seeds)
    assert counter.total == qdq_traffic(spec, operand, hadamard, amax_given, ROWS, COLS).bytes


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block"])
@pytest.mark.parametrize("operand", [Operand.ACTIVATION, Operand.WEIGHT])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_operand_traffic_is_what_the_call_moves(counter, fmt, operand, dtype):
    spec = get_format(fmt)
    x = torch.randn(ROWS, COLS).to(dtype)
    with counter:
        kq.scaled_operand(x, spec, operand, None)
    assert counter.total == scaled_operand_traffic(spec, operand, False, ROWS, COLS, dtype).bytes


def test_the_counts_today():
    """The figures gpu_check divides by (bytes per element): what a one-pass kernel would cut."""
    n = ROWS * COLS
    per = {fmt: qdq_traffic(get_format(fmt), Operand.ACTIVATION, False, False, ROWS, COLS).bytes / n
           for fmt in ("fp8", "fp8_block", "nvfp4")}
    assert per == {"fp8": 20, "fp8_block": 8, "nvfp4": 20}
    assert qdq_traffic(get_format("nvfp4"), Operand.GRADIENT, True, False, ROWS, COLS).bytes / n == 28
    bf16 = scaled_operand_traffic(get_format("fp8"), Operand.ACTIVATION, False, ROWS, COLS, torch.bfloat16)
    assert bf16.bytes / n == 9 and bf16.describe(n) == "9.0 B/elem: abs 4.0, amax 2.0, kernel 3.0"
