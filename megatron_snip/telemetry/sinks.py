"""The run's optional sinks (W&B, TensorBoard) as one object with the sink interface.

    sinks = Sinks.from_config(cfg, run_dir, is_writer=topo.rank == 0)   # None when none is on
    logger = RunLogger(run_dir, is_writer=..., sinks=[sinks] if sinks else [])
    sinks.log_plan(plan, png)                                            # each sink that is on

Each method forwards to every configured sink (``telemetry/wandb_sink.py``,
``telemetry/tensorboard_sink.py``), in that order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_snip.config import Config
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.telemetry.tensorboard_sink import TensorBoardSink
from megatron_snip.telemetry.wandb_sink import WandbSink


class Sinks:
    """Fan-out to ``sinks`` (each with log / log_plan / log_final_plan / log_timeline / close)."""

    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = sinks

    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path, *, is_writer: bool) -> Sinks | None:
        """The sinks ``cfg.logging`` turns on (rank 0 only), or None."""
        found = [s for s in (WandbSink.from_config(cfg, run_dir, is_writer=is_writer),
                             TensorBoardSink.from_config(cfg, run_dir, is_writer=is_writer)) if s is not None]
        return cls(found) if found else None

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for s in self.sinks:
            s.log(step, record)

    def log_plan(self, plan: PrecisionPlan, png_path: str | Path | None = None,
                 costs: Mapping[Any, Mapping[str, float]] | None = None) -> None:
        for s in self.sinks:
            s.log_plan(plan, png_path, costs=costs)

    def log_final_plan(self, plan: PrecisionPlan, png_path: str | Path, step: int) -> None:
        for s in self.sinks:
            s.log_final_plan(plan, png_path, step=step)

    def log_timeline(self, png_path: str | Path, step: int | None = None) -> None:
        for s in self.sinks:
            s.log_timeline(png_path, step=step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
