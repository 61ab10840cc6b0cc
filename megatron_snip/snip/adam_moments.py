"""What SNIP's statistics read of AdamW's state: the preconditioner √v̂ + eps, the step counts, the
moments' norms and m̂'s first-order term (``snip/stats.py`` calls these; docs/snip.md, "Statistics").

Every reader takes the whole tensor of a parameter: the distributed optimizer gathers its DP shards
(``full_state``, a collective called alike on every DP rank). A fused AdamW keeps its step counts
on the device, so they are read in one transfer (``adam_steps``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatron_snip.snip.device_sums import DeviceSums


def adam_denominator(optimizer: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor,
                     step: float | None = None, with_grad: bool = False) -> torch.Tensor:
    """√v̂ + eps of AdamW for ``param`` (bias-corrected, the shape of ``param``).

    ``with_grad=False`` (snip.preconditioner "stored"): the v̂ of AdamW's state after its last step;
    before the first step |g| + eps (what Adam's first update divides by). ``with_grad=True``
    ("with_probe"): the v̂ the next update divides by if its gradient is ``grad``: AdamW first folds
    the gradient in, v ← β2·v + (1-β2)·g², bias-corrected with the step count + 1 (before the first
    step this is |g| + eps too). It bounds |g| / √v̂ by 1/√(1-β2) per element however far ``grad``
    is above v's history. ``step``: the step count if already read (``adam_steps``)."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    eps, beta2 = group["eps"], group["betas"][1]
    state = full_adam_state(optimizer, param)
    if "exp_avg_sq" not in state:
        return grad.abs() + eps
    step = float(state["step"]) if step is None else step
    if with_grad:
        v = state["exp_avg_sq"] * beta2 + grad.float().pow(2) * (1.0 - beta2)
        return (v / (1.0 - beta2 ** (step + 1))).sqrt() + eps
    v_hat = state["exp_avg_sq"] / (1.0 - beta2**step)
    return v_hat.sqrt() + eps


def full_adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """AdamW's state of ``param`` with whole tensors ({} before the first step). The distributed
    optimizer gathers its DP shards (``full_state``: a collective, called alike on every DP rank)."""
    full_state = getattr(optimizer, "full_state", None)
    return full_state(param) if full_state is not None else (optimizer.state.get(param) or {})


def adam_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[int, float]:
    """{id(param): AdamW's step count} of the parameters that have one, read in one transfer (a
    fused AdamW keeps its counts on the device: one read per parameter would sync each time)."""
    states = [(p, full_adam_state(optimizer, p)) for p in params]
    counts = [(id(p), st["step"]) for p, st in states if "exp_avg_sq" in st]
    on_device = [c for _, c in counts if torch.is_tensor(c)]
    read = iter(torch.stack([c.reshape(()).double() for c in on_device]).tolist() if on_device else [])
    return {i: (next(read) if torch.is_tensor(c) else float(c)) for i, c in counts}


def add_adam_norms(optimizer: torch.optim.Optimizer, param: torch.Tensor, s: dict[str, Any],
                   pending: DeviceSums) -> None:
    """s["sq_m"], s["sq_v"]: the squared norms of AdamW's moments of ``param`` (none before its first step)."""
    state = full_adam_state(optimizer, param)
    if "exp_avg" in state:
        pending.set(s, "sq_m", state["exp_avg"].pow(2).sum())
        pending.set(s, "sq_v", state["exp_avg_sq"].pow(2).sum())


def add_momentum_first_order(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                             errors_w: Mapping[str, torch.Tensor], s: dict[str, Any], pending: DeviceSums,
                             step: float | None) -> None:
    """pf["m_dot_ew"] = <m̂, Q(W)-W> per format: the weight error's first-order loss change with the
    expected gradient estimated by AdamW's bias-corrected first moment (0 before the first step)."""
    state = full_adam_state(optimizer, param)
    if "exp_avg" not in state:
        return
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    m_hat = state["exp_avg"].float() / (1.0 - group["betas"][0] ** (float(state["step"]) if step is None else step))
    for f, e_w in errors_w.items():
        pending.set(s["per_format"][f], "m_dot_ew", (m_hat * e_w).sum())
