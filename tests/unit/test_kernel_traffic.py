"""``kernel_calls.bytes_moved`` is the bytes each ``kernel_calls`` call really moves.

Counted, not assumed: every torch op the call runs outside the kernel is seen by a
``TorchDispatchMode`` (bytes of its tensor inputs read + tensor outputs written; allocations and
views move nothing), and every kernel launch (``launch_qdq``: the quantize kernel and the
rotated-amax pass alike) adds what it reads (its input) and writes (its output and, for a
scaled-mm operand or the amax-only pass, the tensor it stores into), under the Triton
interpreter on CPU. One-element tensors (0-d amaxes, the kernel's scalar argument) and the seeds
are left out on both sides, as ``bytes_moved`` says. So a change to a call path (an amax pass
added or fused, a rotation written out) that does not update ``bytes_moved`` fails here - and
``gpu_check``'s ``kernel_bw`` gate, which divides those bytes by the measured time, cannot be off
by a forgotten or a phantom pass.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("TRITON_INTERPRET", "1")
kq = pytest.importorskip("megatron_snip.precision.quantize.kernel_calls", reason="needs Triton")

from megatron_snip.precision.formats import Operand, get_format
from megatron_snip.precision.quantize.noise import draw_seeds

bytes_moved = kq.bytes_moved
ROWS, COLS = 128, 256  # whole 16 x 128 tiles and 128 x 128 blocks, as bytes_moved assumes
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _nbytes(t: object) -> int:
    if isinstance(t, torch.Tensor) and t.numel() > 1:  # one-element tensors: not counted (bytes_moved)
        return t.numel() * t.element_size()
    return 0


class _Bytes(TorchDispatchMode):
    """Sums the bytes torch ops read and write (kernel launches are added by the ``counter`` fixture)."""

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


_AMAX_ONLY = kq._AMAX_ONLY


@pytest.fixture
def counter(monkeypatch):
    mode = _Bytes()
    launch = kq.launch_qdq

    def counted(x, y, scalars, seeds, scales_out, *rest, scaling, out_elements, **kw):
        # the kernel reads x once; it writes y, or (amax-only) one partial per program into
        # scales_out, and for a scaled-mm operand y's float8 codes plus the decode scales
        written = _nbytes(scales_out) if scaling == _AMAX_ONLY else _nbytes(y) + (
            _nbytes(scales_out) if out_elements else 0)
        mode.total += _nbytes(x) + written
        mode.paused = True  # the interpreter's own tensor handling is not device traffic
        try:
            return launch(x, y, scalars, seeds, scales_out, *rest, scaling=scaling, out_elements=out_elements, **kw)
        finally:
            mode.paused = False

    monkeypatch.setattr(kq, "launch_qdq", counted)
    return mode


CASES = [(fmt, operand, hadamard, amax_given, dtype)
         for fmt in ("fp8", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "fp4_block")
         for operand in (Operand.ACTIVATION, Operand.GRADIENT)
         for hadamard in ((False, True) if operand is Operand.GRADIENT and fmt in ("nvfp4", "mxfp4") else (False,))
         for amax_given in ((False, True) if get_format(fmt).uses_tensor_amax else (False,))
         for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("fmt", "operand", "hadamard", "amax_given", "dtype"), CASES,
                         ids=[f"{f}-{o.value}-h{int(h)}-a{int(a)}-{str(d)[6:]}" for f, o, h, a, d in CASES])
def test_qdq_moves_bytes_moved(counter, fmt, operand, hadamard, amax_given, dtype):
    spec = get_format(fmt)
    x = torch.randn(ROWS, COLS).to(dtype)
    seeds = draw_seeds(torch.Generator().manual_seed(0), "cpu") if spec.stochastic_for(operand) else None
    amax = x.float().abs().amax() if amax_given else None
    with counter:
        kq.qdq(x, spec, operand, hadamard, False, amax, seeds)
    assert counter.total == bytes_moved(spec, x.numel(), dtype, hadamard, operand=operand, amax_given=amax_given)


def test_rotated_amax_moves_one_read_and_the_partials(counter):
    """The amax-only pass alone (``quantize`` calls it before an amax reduction over TP)."""
    x = torch.randn(ROWS, COLS)
    with counter:
        kq.rotated_amax(x, False)
    n = x.numel()
    assert counter.total == bytes_moved("nvfp4", n, x.dtype, True) - bytes_moved("nvfp4", n, x.dtype, True,
                                                                                  amax_given=True)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block"])
@pytest.mark.parametrize("operand", [Operand.ACTIVATION, Operand.WEIGHT])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_operand_moves_bytes_moved(counter, fmt, operand, dtype):
    spec = get_format(fmt)
    x = torch.randn(ROWS, COLS).to(dtype)
    with counter:
        kq.scaled_operand(x, spec, operand, None)
    assert counter.total == bytes_moved(spec, x.numel(), dtype, operand=operand, scaled=True)


def test_the_figures_kernel_bw_divides_by():
    """One read and one write per call, plus one read for a tensor amax (bytes per element, 8192^2)."""
    n = 8192 * 8192
    f32, bf16 = torch.float32, torch.bfloat16
    assert bytes_moved("mxfp8", n, f32) == 8 * n  # read 4 + write 4
    assert bytes_moved("fp8", n, f32) == 12 * n  # + the aminmax pass
    assert bytes_moved("fp8", n, f32, amax_given=True) == 8 * n
    assert bytes_moved("nvfp4", n, f32, True) == 12 * n + 8 * n // 2048  # + the rotated amax pass and partials
    assert bytes_moved("mxfp4+rht", n, f32, True) == 8 * n  # the rotation is fused: no extra pass
    assert bytes_moved("fp8_block", n, bf16) == 6 * n  # bf16 read as it is, fp32 written
    assert bytes_moved("fp8_block", n, bf16, scaled=True) == 3 * n + 4 * n // 128
    assert bytes_moved("fp8_block", n, f32, operand=Operand.WEIGHT, scaled=True) == 5 * n + 4 * n // 16384
    assert bytes_moved("fp8", n, bf16, scaled=True) == 5 * n
