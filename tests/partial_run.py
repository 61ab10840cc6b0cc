"""A run stopped by hand after some steps, with a checkpoint: what the resume tests continue."""

from __future__ import annotations


def train_steps_and_save(trainer, steps: int) -> None:
    """Run ``steps`` training steps on ``trainer`` (logging each step's loss as ``fit`` would),
    then save a checkpoint and close its logger, as a run preempted after those steps leaves it."""
    for _ in range(steps):
        res = trainer.train_step(trainer.step)
        trainer.step += 1
        trainer.logger.log_metrics(trainer.step, {"loss": res.loss})
    trainer.save()
    trainer.logger.close()
