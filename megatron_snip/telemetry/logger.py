"""The one rank-0 logger: stdout lines, ``metrics.jsonl`` in the run directory, optional W&B.

Only the rank constructed with ``is_writer=True`` (global rank 0) prints or writes; on every
other rank each method is a no-op, so callers never branch on rank. The progress bar (stderr)
appears only when stderr is a terminal; the per-interval ``step_line`` goes to stdout either way.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm


class RunLogger:
    """Writes ``<run_dir>/metrics.jsonl`` (one JSON object per logged step) and prints progress."""

    def __init__(self, run_dir: str | Path, *, is_writer: bool, progress_total: int | None = None,
                 progress_initial: int = 0, sinks: list[Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.is_writer = is_writer
        self.sinks = sinks or []  # extra sinks with log(step, dict) / close() (e.g. telemetry.wandb_sink)
        self._bar = None
        if is_writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # open for the logger's lifetime (every step appends a line); close() closes it
            self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
            # A bar only on a terminal: in a file (a SLURM .out) it would be one line of carriage returns.
            if progress_total and sys.stderr.isatty():
                self._bar = tqdm(total=progress_total, initial=progress_initial, unit="step", dynamic_ncols=True,
                                 file=sys.stderr, mininterval=1.0)

    def info(self, msg: str) -> None:
        if not self.is_writer:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one JSON line (one write call, so a reader never sees half a record)."""
        if not self.is_writer:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(step, record)

    def metrics_bytes(self) -> int:
        """Length of ``metrics.jsonl`` so far (flushed); a checkpoint records it (0 off rank 0)."""
        if not self.is_writer:
            return 0
        self._metrics.flush()
        return self._metrics.tell()

    def truncate_metrics(self, length: int) -> None:
        """Cut ``metrics.jsonl`` back to its first ``length`` bytes (a resume drops the records
        logged after the checkpoint it continues from, so no step appears twice)."""
        if not self.is_writer:
            return
        self._metrics.flush()
        if self._metrics.tell() > length:
            self._metrics.truncate(length)
            self._metrics.seek(length)

    def progress(self, step: int, **postfix: Any) -> None:
        if self._bar is None:
            return
        self._bar.n = step
        self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()}, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if not self.is_writer:
            return
        if self._bar is not None:
            self._bar.close()
        self._metrics.close()
        for sink in self.sinks:
            sink.close()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep it readable rather than invalid
    return v


def step_line(step: int, max_steps: int, *, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
              tflops_per_rank: float | None, peak_memory: str, skipped: int, fp4_share: float, elapsed_s: float,
              eta_s: float) -> str:
    """One Megatron-style log line for the interval ending at ``step``; ``loss`` is the mean over
    the interval's non-skipped steps, throughput over its wall time."""
    tflops = "" if tflops_per_rank is None else f" | {tflops_per_rank:.2f} TFLOP/s/rank"
    return (f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] step {step:>{len(str(max_steps))}}/{max_steps} | loss {loss:.4f} "
            f"| lr {lr:.3e} | grad norm {grad_norm:.3f} | {tokens_per_s:,.0f} tok/s{tflops} | peak mem {peak_memory} "
            f"| skipped {skipped} | FP4 share {fp4_share:.2f} | elapsed {_hms(elapsed_s)} | ETA {_hms(eta_s)}")


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
