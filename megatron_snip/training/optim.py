"""AdamW with Megatron's parameter groups (no weight decay on norms and embeddings' 1-D params).

On CUDA: torch's fused AdamW (``torch.optim.AdamW(fused=True)``). Its kernel takes the step
guard's skip flag as ``found_inf`` (``training/step_guard.py``: the device decides, as
``torch.amp.GradScaler`` does), so a step makes no host read. apex's FusedAdam, preferred here
before, has no such input: the guard had to read the flag on the host (one ``.item()``, a stream
sync, per step), so it is no longer chosen. On CPU: the foreach implementation (the reference
the main job's losses were recorded with; the fused CPU kernel is tested against it in
``tests/unit/test_optim.py``).

With ``training.distributed_optimizer`` it is the ZeRO-1 ``DistributedOptimizer`` (torch's fused
kernel on CUDA, foreach on CPU).
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
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.adam_eps}
    if cfg.distributed_optimizer:
        return DistributedOptimizer(groups, topo, fused=device.type == "cuda", bucket_mb=cfg.grad_bucket_mb,
                                    overlap=cfg.overlap_grad_reduce, **kwargs)
    if device.type == "cuda":  # the skip decided on the device (found_inf): no host read per step
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(exp_avg m, exp_avg_sq v, step count) of ``param``, or None before the first step."""
    st = optimizer.state.get(param)
    if not st or "exp_avg" not in st:
        return None
    step = st["step"]
    return st["exp_avg"], st["exp_avg_sq"], int(step.item() if torch.is_tensor(step) else step)
