"""Hung- and dead-rank detection: every rank beats a file, every rank watches the others.

    hb = Heartbeat(run_dir / "heartbeat", rank, world_size, timeout_s=cfg.parallel.collective_timeout_s)
    hb.start()
    ...  hb.step = trainer.step  (the trainer updates it each step)
    hb.stop()

A daemon thread per rank rewrites ``<dir>/rank_<r>.json`` every ``interval_s`` (and the
training loop at the start of each step) with a beat counter, the current step, host and pid, and reads the other ranks' files. A rank whose
counter has not moved for ``timeout_s / 2`` (measured on the watcher's own monotonic clock, so
clock skew between nodes does not matter) is declared hung - a stopped (SIGSTOP), swapped-out
or dead process: the watcher prints one line naming it and its last step and ends its own
process with ``EXIT_HUNG``, so the job ends well before the collective timeout would fire
in a survivor (on gloo a bare backend traceback; on NCCL torch's own watchdog thread ends the
process without any Python exception, so this thread is the only path that names the rank).
The thread runs while the main thread waits in a collective, so a slow collective never looks
like a hang; only a process that stops beating does.

Under torchrun (``TORCHELASTIC_RUN_ID`` set) the watcher also ends a worker whose agent is
gone (its parent pid changed), so orphaned workers never keep training into the run directory.

The directory must be shared by all ranks - the same requirement as the run directory's
checkpoints. Nothing here calls ``torch.distributed``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megatron_snip.atomic_io import atomic_write_text

EXIT_HUNG = 4  # another rank stopped responding (or the launcher died)


class Heartbeat:
    """This rank's heartbeat writer + watcher of the others (see module docstring).

    Args:
        directory: shared folder for the ``rank_<r>.json`` files (created).
        rank, world_size: global rank of this process and the number of ranks.
        timeout_s: ``parallel.collective_timeout_s``; a rank silent for half of it is hung.
        interval_s: seconds between beats (default min(5, timeout_s / 10)).
        on_hang: called with the message instead of print + ``os._exit(EXIT_HUNG)`` (tests).
    """

    def __init__(self, directory: str | Path, rank: int, world_size: int, timeout_s: float, *,
                 interval_s: float | None = None, on_hang: Callable[[str], None] | None = None) -> None:
        self.dir = Path(directory)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = interval_s if interval_s is not None else min(5.0, timeout_s / 10)
        self.limit_s = timeout_s / 2
        self.step: int | None = None  # set by the training loop
        self._on_hang = on_hang or _die
        self._beats = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ppid = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
        self._host = socket.gethostname()

    def start(self) -> Heartbeat:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="megatron-snip-heartbeat", daemon=True)
        self._thread.start()
        return self

    def await_verdict(self) -> None:
        """After a failed collective (a peer reset the connection): give the watcher the time it
        needs to name the rank that stopped beating - it then ends the process with that message.
        Returns when no rank is declared hung within ``timeout_s / 2`` + two beats."""
        if self._thread is not None:
            self._thread.join(self.limit_s + 2 * self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)

    # --- trainer callback: the step the heartbeat reports -------------------------------------
    def before_step(self, trainer: object, step: int) -> None:
        """Record (and write at once, so a rank that stops inside this step is reported at it) the step."""
        self.step = step
        try:
            self._beat()
        except OSError:
            pass

    def after_step(self, trainer: object, step: int) -> None:
        pass

    def on_train_end(self, trainer: object) -> None:
        pass

    def _beat(self) -> None:
        with self._lock:  # the training loop and the thread both beat; one temp file name
            self._beats += 1
            atomic_write_text(self.dir / f"rank_{self.rank:05d}.json", json.dumps(
                {"beat": self._beats, "step": self.step, "host": self._host, "pid": os.getpid()}))

    def _run(self) -> None:
        seen: dict[int, tuple[int | None, float, dict]] = {}  # rank -> (beat, local time it changed, record)
        started = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except OSError:
                pass  # a full or flaky disk must not kill the run; the others will notice if it lasts
            now = time.monotonic()
            if self._ppid is not None and os.getppid() != self._ppid:
                self._on_hang(f"error: rank {self.rank}: the torchrun agent (pid {self._ppid}) is gone; stopping "
                              f"this worker at step {self.step} so it does not keep training into the run directory")
                return
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                record = _read(self.dir / f"rank_{r:05d}.json")
                beat = record.get("beat")
                last = seen.get(r)
                if last is None or beat != last[0]:
                    seen[r] = (beat, now, record)
                    continue
                if now - last[1] > self.limit_s:
                    if not record:
                        self._on_hang(f"error: rank {r} never wrote its heartbeat to {self.dir} within "
                                      f"{self.limit_s:.0f} s; it did not start, or the run directory is not shared "
                                      f"by all nodes (it must be: checkpoints need that too)")
                        return
                    where = f"{record.get('host', '?')} pid {record.get('pid', '?')}"
                    step = record.get("step")
                    self._on_hang(
                        f"error: rank {r} ({where}) stopped responding at step {step}: no heartbeat for "
                        f"{now - max(last[1], started):.0f} s (limit {self.limit_s:.0f} s = parallel.collective_timeout_s="
                        f"{self.timeout_s:g} / 2); ending the job from rank {self.rank}. The process is stopped, "
                        f"swapped out or dead - see rank {r}'s log")
                    return


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _die(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_HUNG)  # the main thread may be blocked in a collective: no clean unwinding is possible
