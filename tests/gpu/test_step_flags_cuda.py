"""The stop and guard flags' CUDA contracts (issue #24 item 3 follow-up); skipped without CUDA.

CPU tests model them (tests/unit/test_step_guard.py, test_signals.py); these check what only a GPU
shows: ``LaggedFlags`` reads a step's flags without draining the stream (the next step's work is
still running after the read), and ``StopSignal.flag_on``'s copy reads the pinned host flag when
the GPU reaches it, not when the host queues it. ``torch.cuda._sleep`` stands in for a step's
kernels (it spins the stream for a number of cycles: ~0.5 s here on any current GPU).
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.training.preemption import StopSignal
from megatron_snip.training.step_guard import LaggedFlags, LateFlags, StepResult

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPIN_CYCLES = 1_000_000_000


def _result(step: int, stop: float, refused: float) -> StepResult:
    zero = torch.zeros((), device="cuda")
    return StepResult(step, zero, zero, zero, torch.full((), stop, device="cuda"), zero, zero,
                      torch.full((), refused, device="cuda"))


def test_lagged_flags_read_the_step_before_while_the_stream_runs_on():
    flags = LaggedFlags(torch.device("cuda"))
    assert flags.exchange(_result(0, 1.0, 0.0)) is None
    torch.cuda._sleep(SPIN_CYCLES)  # step 1's work, queued behind step 0's copy
    late = flags.exchange(_result(1, 0.0, 1.0))
    assert late == LateFlags(0, True, False)
    assert not torch.cuda.current_stream().query(), "the read waited for the whole stream"
    torch.cuda.synchronize()
    assert flags.exchange(_result(2, 0.0, 0.0)) == LateFlags(1, False, True)


def test_the_stop_flag_copy_reads_the_pinned_flag_when_the_gpu_reaches_it():
    stop = StopSignal()  # not entered: no handlers, only the flag
    assert float(stop.flag_on(torch.device("cuda"))) == 0.0  # pins the flag (an allocation may sync)
    torch.cuda._sleep(SPIN_CYCLES)  # the GPU is busy with an earlier step
    flag = stop.flag_on(torch.device("cuda"))  # queued behind it, while the flag is still 0
    assert not torch.cuda.current_stream().query()
    stop._flag.fill_(1.0)  # the watcher thread's write, as the signal arrives
    assert float(flag) == 1.0, "the copy read the flag when the host queued it, not when the GPU ran it"
