"""A short SNIP-controlled run on a small model, optionally killed after a step (for resume tests).

Shared by the controller, run-budget, cost-memory, kept-forward and depth-prior tests, with the
resume, the loss log and the offline planner they compare against."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from megatron_snip.config import load_config
from megatron_snip.snip.controller import SnipController
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"


class _Crash(Exception):
    pass


class _CrashAfter:
    """A callback that kills the run after step ``n`` (its checkpoint, if one was due, already written)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def before_step(self, trainer, step):
        pass

    def after_step(self, trainer, step):
        if trainer.step == self.n:
            raise _Crash


def fit_snip(overrides: list[str], crash_after: int | None = None,
             config: str = TINY) -> tuple[Trainer, SnipController]:
    """Train ``config`` with ``overrides`` under a SnipController (ending as ``training.run.run_training``
    does), or until ``crash_after`` steps; the trainer (its logger closed) and the controller."""
    cfg = load_config(config, overrides)
    tr = Trainer(cfg)
    ctl = SnipController(cfg, tr)
    try:
        tr.fit([ctl] + ([_CrashAfter(crash_after)] if crash_after else []))
        ctl.on_train_end(tr)
    except _Crash:
        pass
    tr.logger.close()
    return tr, ctl


def preempted_and_resumed(overrides: list[str], run_dir: Path, crash_after: int,
                          save_interval: int = 4) -> tuple[Trainer, SnipController]:
    """``overrides`` trained into ``run_dir`` instead of their own ``training.run_dir``, checkpointing every
    ``save_interval`` steps and killed after ``crash_after``, then resumed to the end: the resumed trainer
    and controller (compare them with an uninterrupted run of ``overrides``)."""
    moved = [o for o in overrides if not o.startswith("training.run_dir")] + [f"training.run_dir={run_dir}"]
    fit_snip(moved + [f"training.save_interval={save_interval}"], crash_after=crash_after)
    return fit_snip(moved + ["training.resume=true"])


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss, from ``run_dir/metrics.jsonl``."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@functools.cache
def solve_plan_script() -> ModuleType:
    """``scripts/solve_plan.py`` (the offline planner) imported as the module ``solve_plan``."""
    spec = importlib.util.spec_from_file_location("solve_plan", "scripts/solve_plan.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["solve_plan"] = mod
    spec.loader.exec_module(mod)
    return mod
