"""Wire a run together: topology, logger, trainer, SNIP controller; print the outcome."""

from __future__ import annotations

from typing import Any

from megatron_snip.config import Config
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.training.trainer import Trainer


def run_training(cfg: Config, topo: ParallelTopology | None = None, callbacks: list[Any] | None = None) -> dict[str, float]:
    """Train as ``cfg`` says on this rank of ``topo`` (None: one process); returns the final evaluation.

    ``callbacks`` run before the SNIP controller's (e.g. the heartbeat that reports the step)."""
    trainer = Trainer(cfg, topo)
    callbacks = list(callbacks or [])
    if cfg.snip.enabled:
        from megatron_snip.snip.controller import SnipController

        callbacks.append(SnipController(cfg, trainer))
    try:
        final = trainer.fit(callbacks)
        for cb in callbacks:
            cb.on_train_end(trainer)
        trainer.logger.info("final: " + " ".join(f"{k}={v:.4f}" for k, v in final.items()))
        return final
    finally:
        trainer.logger.close()
