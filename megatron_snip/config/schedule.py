"""Learning-rate schedules: linear warmup, then cosine, WSD (warmup-stable-decay) or constant.

The LR is a pure function of the step and ``TrainingConfig``, so a resumed run needs no scheduler
state. It lives with the config (not in ``training/``) because SNIP's run-level FP4 budget
(``snip/budget.py``) and the dry run price each re-plan interval by the LR it will train at, and
both sit below ``training/`` in the import layers; ``training/lr.py`` re-exports it.
"""

from __future__ import annotations

import math

from megatron_snip.config.sections import TrainingConfig


def wsd_decay_start(cfg: TrainingConfig) -> int:
    """The first step of WSD's decay phase (``lr_schedule = "wsd"``): the last
    ``round(wsd_decay_fraction * max_steps)`` steps (at least one) decay linearly to ``min_lr``."""
    return cfg.max_steps - max(1, round(cfg.wsd_decay_fraction * cfg.max_steps))


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """LR for optimizer step ``step`` (0-based) of ``cfg.max_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly to min_lr over the last wsd_decay_fraction of steps
    decay_start = wsd_decay_start(cfg)
    decay_steps = cfg.max_steps - decay_start
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start) / decay_steps)
    return cfg.lr + (cfg.min_lr - cfg.lr) * progress
