"""``training.profile_steps = [start, end]``: a torch.profiler trace of those steps, one file per rank.

``StepProfiler`` is a training callback: it starts ``torch.profiler.profile`` (CPU activities, and
CUDA ones on a GPU) before step ``start`` and stops it after step ``end`` (steps counted from 1, as
the log counts them; a run resumed inside the window profiles the rest of it), then writes
``<run_dir>/profile/trace_rank<R>.json`` - Chrome trace JSON, which Perfetto (ui.perfetto.dev),
chrome://tracing and TensorBoard's profiler plugin load. Each step is one region named
``step:<N>``; the quantizers and GEMMs inside are labelled by ``precision/profile_labels.py``
(``quantize:<format>:<operand>``, ``gemm:<fprop|dgrad|wgrad>:<format>``), so a mixed plan's time
can be read per format. The work at those steps' boundaries (evaluation, re-plan, checkpoint) is in
the trace too. Off (``[]``), nothing here runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def trace_path(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s trace goes."""
    return Path(run_dir) / "profile" / f"trace_rank{rank}.json"


class StepProfiler:
    """Callback recording steps ``steps[0]..steps[1]`` (1-based) with torch.profiler on this rank."""

    def __init__(self, steps: tuple[int, ...], run_dir: Path, rank: int, log: Callable[[str], None]) -> None:
        self.start, self.end = steps
        self.path = trace_path(run_dir, rank)
        self.log = log
        self._prof: Any = None
        self._step_region: Any = None
        self.written: Path | None = None

    def before_step(self, host: object, step: int) -> None:
        n = step + 1  # the step about to run, as the log counts it
        if not self.start <= n <= self.end:
            return
        if self._prof is None and self.written is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()
        if self._prof is not None:
            self._step_region = record_function(f"step:{n}")
            self._step_region.__enter__()

    def after_step(self, host: object, step: int) -> None:
        if self._step_region is not None:
            self._step_region.__exit__(None, None, None)
            self._step_region = None
        if self._prof is not None and step + 1 >= self.end:
            self.close()

    def on_train_end(self, host: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop recording (if it is) and write the trace; a run that ends early writes what it recorded."""
        if self._step_region is not None:
            self._step_region.__exit__(None, None, None)
            self._step_region = None
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.written = self.path
        self.log(f"profile: steps {self.start}-{self.end} traced to {self.path} (Chrome trace JSON: open in "
                 f"ui.perfetto.dev or chrome://tracing)")

    @staticmethod
    @contextlib.contextmanager
    def on_exit(profiler: StepProfiler | None) -> Iterator[None]:
        """Around a training loop: whatever ends it, the trace recorded so far is written."""
        try:
            yield
        finally:
            if profiler is not None:
                profiler.close()
