"""AdamW with Megatron's parameter groups (no weight decay on norms and embeddings' 1-D params).

Uses apex's FusedAdam on CUDA when apex is importable (NVIDIA apex, built from source - it is
not on PyPI), else torch's fused AdamW on CUDA, else the foreach implementation on CPU. With
``training.distributed_optimizer`` it is the ZeRO-1 ``DistributedOptimizer`` (torch's fused
kernel on CUDA, foreach on CPU; apex is not used there).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_snip.config import TrainingConfig
from megatron_snip.parallel.distributed_optimizer import DistributedOptimizer
from megatron_snip.parallel.topology import ParallelTopology


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainingConfig, device: torch.device,
                    topo: ParallelTopology) -> torch.optim.Optimizer | DistributedOptimizer:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
    if cfg.distributed_optimizer:
        return DistributedOptimizer(groups, topo, fused=device.type == "cuda", **kwargs)
    if device.type == "cuda":
        try:
            from apex.optimizers import FusedAdam  # type: ignore[import-not-found]

            return FusedAdam(groups, adam_w_mode=True, **kwargs)
        except ImportError:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(exp_avg m, exp_avg_sq v, step count) of ``param``, or None before the first step."""
    st = optimizer.state.get(param)
    if not st or "exp_avg" not in st:
        return None
    step = st["step"]
    return st["exp_avg"], st["exp_avg_sq"], int(step.item() if torch.is_tensor(step) else step)
