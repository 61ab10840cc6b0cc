"""Preemption: catch the signal a scheduler sends before it kills the job.

SLURM sends ``SIGUSR1`` ahead of the time limit when asked (``#SBATCH --signal=B:USR1@300``,
forwarded to the workers by ``launch/slurm/train.sbatch``); torchrun forwards ``SIGTERM`` (and
``SIGUSR1`` with ``--signals-to-handle``) to its workers on shutdown; ``kill`` and ``scancel``
send ``SIGTERM``. The handler only records the signal: the training loop checks it at a step
boundary, all ranks agree, save a checkpoint and leave with ``EXIT_PREEMPTED`` so the
job can be requeued and resume with ``training.resume = "auto"``. ``SIGINT`` (Ctrl-C) asks the same.

When the stop comes. A single process stops at the next boundary. In a distributed run each rank
puts its flag (``StopSignal.flag_on``) into a step's flag all-reduce (after forward/backward,
before the optimizer update) and every rank reads the reduced flag one step later without a host
sync (``step_guard.LaggedFlags``): a signal that reaches any rank before its step ``j`` reduces
the flags stops every rank after step ``j + 1``; one that lands in step ``j``'s short tail after
that all-reduce (the optimizer update, the parameter norm) after step ``j + 2``; a log, eval or
save step in between stops the run there. On CUDA, ``j`` is the step the GPU is running, not the
one the host is queuing (a fused optimizer lets the host run about a step ahead): the flag is a
copy from pinned memory that the watcher thread sets as the signal arrives, read when the GPU
reaches it. In time, from the signal to the checkpoint's start: under two step times plus one
step's tail, plus one evaluation batch (an evaluation is aborted, see below) or a re-plan at
those boundaries. ``training.preempt_grace_s`` must cover that and the checkpoint write (180 s:
steps up to about 50 s with a 60 s write), and the scheduler's warning must exceed it.

At a step boundary the checkpoint comes first: a stop already requested there skips that
boundary's evaluation, and one that arrives during the evaluation aborts it between two of its
batches (``Trainer.evaluate``; in a distributed run the ranks agree through one flag all-reduce
per evaluation batch), so a long evaluation never costs the checkpoint that could be written.

A step boundary can be far away (a long step, a re-plan), and schedulers and people expect a
second signal to end a process at once. So after the first signal a watcher thread ends the
process (``os._exit(128 + signal)``) on a second one, or when ``training.preempt_grace_s`` has
passed. It never writes a checkpoint itself: between two step boundaries the weights, optimizer
moments and random streams may be half-way through an update, and the other ranks cannot join a
save, so nothing can be committed safely there. Its message says where the main thread was
(``StopSignal.set_phase``: inside a step, at a boundary doing what, or writing a checkpoint) and
names the newest committed checkpoint (where ``resume=auto`` will continue; checkpoints are
committed atomically, so a save cut short leaves only its temp directory, which the next start
removes). The watcher reads the
signals from ``signal.set_wakeup_fd``, which CPython's C-level handler writes even while the
main thread is inside a long C call or a collective, where Python handlers cannot run.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Self

import torch

from megatron_snip.parallel import comm
from megatron_snip.parallel.topology import ParallelTopology

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was written, requeue and resume


def describe_last_checkpoint(ckpt_root: Path) -> str:
    """One sentence for a forced stop: where ``training.resume=auto`` will continue."""
    from megatron_snip.training import checkpoint as ckpt

    step = ckpt.latest_checkpoint(ckpt_root)
    if step is None:
        return f"No checkpoint has been committed in {ckpt_root} yet: a resumed run starts from step 0."
    return (f"The newest committed checkpoint is step {step} ({ckpt.step_dir(ckpt_root, step)}): "
            f"training.resume=auto continues from there.")


def stop_reached_any_rank(stop: StopSignal, topo: ParallelTopology, device: torch.device) -> bool:
    """Whether a stop signal has reached any rank of ``topo`` by now: one answer for all ranks (in
    a distributed run one flag all-reduce over the world group, and a host sync: called between
    evaluation batches, which sync anyway; every rank must call it at the same points)."""
    if not topo.is_distributed:
        return stop.received is not None
    return bool(comm.all_reduce_max(stop.flag_on(device), topo.world_group))


class TrainingPreempted(RuntimeError):
    """Raised after the preemption checkpoint is committed; the message says where it is."""


class StopSignal:
    """Context manager recording the first of ``PREEMPT_SIGNALS`` received (main thread only;
    elsewhere it records nothing), and ending the process at once on a second one or after
    ``grace_s`` seconds (0: no deadline). ``last_checkpoint()`` describes the newest committed
    checkpoint for that exit's message. ``flag_on(device)`` is the flag a step reduces over the
    ranks. Restores the previous handlers on exit."""

    def __init__(self, grace_s: float = 0.0, last_checkpoint: Callable[[], str] | None = None) -> None:
        self.received: signal.Signals | None = None
        self.grace_s = grace_s
        self.last_checkpoint = last_checkpoint or (lambda: "no checkpoint")
        self._previous: dict[int, object] = {}
        self._previous_fd: int | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None  # (reader, writer) of the wakeup fd
        self._watcher: threading.Thread | None = None
        self._flag = torch.zeros(())  # 1.0 once a signal came; set by the watcher thread at once
        # (kind, step, activity): what the main thread is doing, for a forced stop's message (set_phase)
        self.phase: tuple[str, int, str] | None = None

    def set_phase(self, kind: str, step: int, activity: str = "") -> None:
        """Record what the main thread is doing: ``"step"`` (computing step ``step``, counted
        from 1 as the log counts), ``"boundary"`` (after step ``step``, doing ``activity``: an
        evaluation, a re-plan) or ``"save"`` (writing checkpoint ``step``). Read by the watcher
        thread only to word its message (one tuple assignment: atomic under the GIL)."""
        assert kind in ("step", "boundary", "save"), kind
        self.phase = (kind, step, activity)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def flag_on(self, device: torch.device) -> torch.Tensor:
        """This rank's stop flag (0-d fp32 on ``device``: 1.0 once a stop signal came) for a step's
        flag all-reduce, without a host sync. On CUDA it is a ``non_blocking`` copy of a pinned host
        flag that the watcher thread sets as the signal arrives: the copy reads it when the GPU
        reaches it, not when the host queues the step, which a fused optimizer lets run about a step
        ahead (see "When the stop comes" above)."""
        if device.type == "cuda" and not self._flag.is_pinned():
            self._flag = self._flag.pin_memory()
        if self.received is not None:  # the watcher may not have run yet (or signals came elsewhere)
            self._flag.fill_(1.0)
        return self._flag.to(device, non_blocking=True, copy=True)

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._pair = socket.socketpair()
            for sock in self._pair:
                sock.setblocking(False)
            self._previous_fd = signal.set_wakeup_fd(self._pair[1].fileno(), warn_on_full_buffer=False)
            for s in PREEMPT_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            self._watcher = threading.Thread(target=self._watch, args=(self._pair[0],), name="stop-signal-watcher",
                                             daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._pair is not None:
            signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
            reader, writer = self._pair
            writer.close()  # EOF on the reader: the watcher returns
            # ... and is joined here. A daemon thread still finishing when the interpreter shuts down
            # is ended by pthread_exit during finalization, which aborted the process ("terminate
            # called without an active exception", exit 134) after a finished run: 2 of 180 exits of
            # a script that only enters and leaves this context (tests/unit/test_signals.py).
            if self._watcher is not None:
                self._watcher.join(timeout=10.0)
                self._watcher = None
            reader.close()
            self._pair = None

    def _watch(self, reader: socket.socket) -> None:
        """Count the stop signals as they arrive; on the second, or at the deadline, end the process."""
        import select

        first: tuple[signal.Signals, float] | None = None
        while True:
            timeout = None if first is None or not self.grace_s else max(0.0, first[1] + self.grace_s - time.monotonic())
            try:
                ready, _, _ = select.select([reader], [], [], timeout)
                data = reader.recv(64) if ready else b""
            except (OSError, ValueError):
                return  # closed by __exit__
            if ready and not data:
                return
            for signum in data:
                if signum not in PREEMPT_SIGNALS:
                    continue
                sig = signal.Signals(signum)
                if first is None:
                    first = (sig, time.monotonic())
                    self._flag.fill_(1.0)  # read by the GPU's next flag copy, even if the main thread is busy
                else:
                    self._force(sig, f"a second stop signal ({sig.name}, after {first[0].name})")
            if first is not None and self.grace_s and not ready:
                self._force(first[0], f"training.preempt_grace_s={self.grace_s:g} s passed after {first[0].name} "
                                      f"before the run stopped at a step boundary")

    def _force(self, sig: signal.Signals, why: str) -> None:
        try:
            where = self.last_checkpoint()
        except Exception as e:  # noqa: BLE001 - the message must go out whatever the filesystem says
            where = f"(the checkpoint directory could not be read: {e})"
        print(f"stopped at once: {why}. {self._what_was_lost()} {where}", file=sys.stderr, flush=True)
        os._exit(128 + int(sig))

    def _what_was_lost(self) -> str:
        """One sentence for a forced stop, true to where the main thread was (``phase``)."""
        kind, step, activity = self.phase or ("step", 0, "")
        if kind == "boundary":
            return (f"No checkpoint was written for step {step}: the run was at the step boundary after it "
                    f"({activity}) and the checkpoint was to come next; one stop signal and a training.preempt_grace_s "
                    f"longer than that lets it be written.")
        if kind == "save":
            return (f"The checkpoint of step {step} was being written and is not committed (a save is committed only "
                    f"once complete; its temporary directory is removed at the next start).")
        inside = f" (inside step {step})" if step else ""
        return (f"No checkpoint was written for the work since the last one: the weights were between step "
                f"boundaries{inside}, where none can be committed safely.")
