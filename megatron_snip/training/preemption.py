"""Preemption: catch the signal a scheduler sends before it kills the job.

SLURM sends ``SIGUSR1`` ahead of the time limit when asked (``#SBATCH --signal=B:USR1@300``,
forwarded to the workers by ``launch/slurm/train.sbatch``); torchrun forwards ``SIGTERM`` (and
``SIGUSR1`` with ``--signals-to-handle``) to its workers on shutdown; ``kill`` and ``scancel``
send ``SIGTERM``. The handler only records the signal: the training loop checks it at the next
step boundary, all ranks agree, save a checkpoint and leave with ``EXIT_PREEMPTED`` so the
job can be requeued and resume with ``training.resume = "auto"``.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Self

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was written, requeue and resume


class TrainingPreempted(RuntimeError):
    """Raised after the preemption checkpoint is committed; the message says where it is."""


class StopSignal:
    """Context manager recording the first of ``PREEMPT_SIGNALS`` received (main thread only;
    elsewhere it records nothing). Restores the previous handlers on exit."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for s in PREEMPT_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
