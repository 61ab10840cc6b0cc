"""A short SNIP-controlled run on a small model, optionally killed after a step (for resume tests).

Shared by the controller, run-budget and cost-memory tests."""

from __future__ import annotations

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
