"""What the benchmarks share: a trainer without a progress bar, uniform plans, and the machine they ran on."""

from __future__ import annotations

import os
import platform

import torch

from megatron_snip.config import Config
from megatron_snip.precision.plan import PrecisionPlan


def build_trainer(cfg: Config):
    """A ``Trainer`` logging to ``cfg.training.run_dir`` without a progress bar (the benchmark prints its own lines)."""
    from megatron_snip.telemetry.logger import RunLogger
    from megatron_snip.training.trainer import Trainer

    return Trainer(cfg, logger=RunLogger(cfg.training.run_dir, is_writer=True))


def uniform_plan(trainer, fmt: str) -> PrecisionPlan:
    """Every GEMM of every linear in ``fmt``."""
    return PrecisionPlan.uniform(fmt, trainer.cfg.model.num_layers, trainer.linear_numel)


def machine() -> dict:
    """The facts a timing depends on, recorded next to it."""
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "torch": torch.__version__, "load_avg_at_start": list(os.getloadavg())}
