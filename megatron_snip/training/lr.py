"""Learning-rate schedules: linear warmup, then cosine, WSD (warmup-stable-decay) or constant.

The LR is a pure function of the step, so a resumed run needs no scheduler state.
"""

from __future__ import annotations

import math

from megatron_snip.config import TrainingConfig


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
    decay_steps = max(1, round(cfg.wsd_decay_fraction * cfg.max_steps))
    decay_start = cfg.max_steps - decay_steps
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start) / decay_steps)
    return cfg.lr + (cfg.min_lr - cfg.lr) * progress
