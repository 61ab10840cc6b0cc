"""AdamW with Megatron's parameter groups (no weight decay on norms and embeddings' 1-D params).

Uses apex's FusedAdam on CUDA when apex loads (NVIDIA apex, built from source - it is not on
PyPI; NGC PyTorch images ship it), else torch's fused AdamW on CUDA, else the foreach
implementation on CPU.

apex's FusedAdam is adapted to torch's optimizer interface, which the trainer and SNIP's
statistics rely on (``ApexAdamW``): ``zero_grad(set_to_none=...)`` (apex's takes no argument),
and a per-parameter ``state["step"]`` next to ``exp_avg``/``exp_avg_sq`` (apex counts steps per
parameter group). An apex that is installed but fails to load or to build its optimizer (a
CUDA extension missing or built for another torch: RuntimeError, OSError, ...) falls back to
torch's fused AdamW with the cause recorded (``precision.fallbacks``: warning + text log).

With ``training.distributed_optimizer`` it is the ZeRO-1 ``DistributedOptimizer`` (torch's fused
kernel on CUDA, foreach on CPU; apex is not used there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_snip.config import TrainingConfig
from megatron_snip.parallel.distributed_optimizer import DistributedOptimizer
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.precision import fallbacks


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _apex_adamw(groups: list[dict], **kwargs: Any) -> torch.optim.Optimizer:
    """apex FusedAdam in AdamW mode behind torch's interface (raises whatever apex raises)."""
    from apex.optimizers import FusedAdam  # type: ignore[import-not-found]

    class ApexAdamW(FusedAdam):
        """apex FusedAdam with torch's ``zero_grad(set_to_none)`` and a per-parameter ``state["step"]``."""

        def zero_grad(self, set_to_none: bool = True) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()

        def step(self, closure: Any = None) -> Any:
            loss = super().step(closure)
            for group in self.param_groups:
                if "step" not in group:  # this apex keeps its own per-parameter step
                    continue
                for p in group["params"]:
                    if p in self.state and "exp_avg" in self.state[p]:
                        self.state[p]["step"] = group["step"]
            return loss

    return ApexAdamW(groups, adam_w_mode=True, **kwargs)


def build_optimizer(model: nn.Module, cfg: TrainingConfig, device: torch.device,
                    topo: ParallelTopology) -> torch.optim.Optimizer | DistributedOptimizer:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.adam_eps}
    if cfg.distributed_optimizer:
        return DistributedOptimizer(groups, topo, fused=device.type == "cuda", bucket_mb=cfg.grad_bucket_mb,
                                    overlap=cfg.overlap_grad_reduce, **kwargs)
    if device.type == "cuda":
        try:
            return _apex_adamw(groups, **kwargs)
        except ImportError:
            pass  # no apex: the usual case outside NGC images
        except Exception as e:  # noqa: BLE001 - apex present but broken: say so, use torch's
            fallbacks.record("apex FusedAdam failed to load; using torch.optim.AdamW(fused=True)",
                             f"{type(e).__name__}: {e}")
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(exp_avg m, exp_avg_sq v, step count) of ``param``, or None before the first step."""
    st = optimizer.state.get(param)
    if not st or "exp_avg" not in st:
        return None
    step = st["step"]
    return st["exp_avg"], st["exp_avg_sq"], int(step.item() if torch.is_tensor(step) else step)
