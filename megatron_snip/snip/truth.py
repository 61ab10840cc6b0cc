"""Measured divergences: what SNIP's estimates stand for, measured by brute force.

For every precision linear ℓ and format f, with every other GEMM in BF16, on n micro-batches
(each (B, S+1) tokens):

    loss change     ΔL(ℓ,f)     = loss with only ℓ's fprop in f − the all-BF16 loss (signed)
    update change   ΔW_g(ℓ,f)   = ‖u_f − u‖ / ‖u‖ with only ℓ's GEMM g (dgrad, wgrad or both) in f,
                                  u the AdamW direction m̂'/(√v̂'+eps) that batch's gradient would
                                  give from the optimizer's current state (no step taken, no decay),
                                  over all parameters

per batch. ``experiments/validate_metrics.py`` checks SNIP's predictions against these on held-out
batches; the ``truth`` policy (``snip/policies.py``) plans with them instead of SNIP's estimates, on
training batches, to tell how much of SNIP's gap to BF16 is its metric's fault.

Cost, with L linears, F formats and n batches: n·(1 + L·F) forwards and n·(1 + 2·L·F)
forward-backwards (dgrad and wgrad measured apart) — per batch and format 32 forwards and 64
forward-backwards on an 8-block model, against SNIP's ~3 passes per probe batch. A research oracle,
not a re-plan to run at scale.

One process only: ``forward_loss`` is the whole model's loss (pp = 1) and the update norms are
taken over this rank's parameters (tp = dp = 1); ``check_single_process`` says so.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.snip.host import ProbeHost
from megatron_snip.snip.stats import key_of

# Which of a linear's backward GEMMs run in the format, per measured update change.
UPDATE_GEMMS = {
    "dgrad": lambda f: GemmPrecision(dgrad=f),
    "wgrad": lambda f: GemmPrecision(wgrad=f),
    "both": lambda f: GemmPrecision(dgrad=f, wgrad=f),
}


def check_single_process(world_size: int, what: str) -> None:
    """ValueError unless one process holds the whole model (see the module docstring)."""
    if world_size != 1:
        raise ValueError(f"{what} measures divergences with whole-model passes on one process; got a world of "
                         f"{world_size} ranks: run it with parallel.tp = parallel.pp = 1 on a single process")


def adam_direction(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                   grads: list[torch.Tensor]) -> torch.Tensor:
    """The AdamW direction m̂'/(√v̂'+eps) these gradients would produce from ``optimizer``'s state
    (no weight decay, no step taken), flattened over ``params`` in order."""
    out = []
    for p, g in zip(params, grads):
        group = next(gr for gr in optimizer.param_groups if any(q is p for q in gr["params"]))
        b1, b2 = group["betas"]
        eps = group["eps"]
        st = optimizer.state.get(p) or {}
        t = float(st["step"]) + 1 if "step" in st else 1.0
        m = b1 * st["exp_avg"] + (1 - b1) * g if "exp_avg" in st else (1 - b1) * g
        v = b2 * st["exp_avg_sq"] + (1 - b2) * g * g if "exp_avg_sq" in st else (1 - b2) * g * g
        out.append(((m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)).flatten())
    return torch.cat(out)


def gradients(host: ProbeHost, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of ``tokens``' mean loss for every parameter (zeros where none flows);
    leaves no gradient behind."""
    host.optimizer.zero_grad(set_to_none=True)
    host.forward_backward([tokens])
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in host.model.parameters()]
    host.optimizer.zero_grad(set_to_none=True)
    return grads


@contextlib.contextmanager
def all_bf16(host: ProbeHost) -> Iterator[list]:
    """Every precision linear in BF16 for the block (the reference every change is measured
    against), the plan in force restored after; yields the linears."""
    linears = list(host.model.precision_linears())
    saved = [lin.precision for lin in linears]
    for lin in linears:
        lin.set_precision(GemmPrecision())
    try:
        yield linears
    finally:
        for lin, prec in zip(linears, saved):
            lin.set_precision(prec)


def loss_changes(host: ProbeHost, formats: tuple[str, ...], batches: list[torch.Tensor], *,
                 mirrored: bool = False) -> dict[tuple[str, str], list[float]]:
    """{(linear key, format): [ΔL per batch]}: one forward per linear, format and batch.

    ``mirrored``: the linear's output moved by −e_Y instead (Y − (Y_f − Y)). Half the sum of the
    two is the even part of the loss change, ½·e_Yᵀ·H·e_Y + O(e⁴); half the difference the odd
    part, <G, e_Y> + O(e³): the truth of each Taylor term on its own."""
    def mirror(module, x):
        y = module.local_gemm(x, GemmPrecision())
        return 2 * y - module.local_gemm(x, module.precision)

    out = {}
    with all_bf16(host) as linears, torch.no_grad():
        base_loss = [float(host.forward_loss(x)) for x in batches]
        for lin in linears:
            for f in formats:
                lin.set_precision(GemmPrecision(fprop=f))
                lin.probe = mirror if mirrored else None
                try:
                    out[key_of(lin), f] = [float(host.forward_loss(x)) - b for x, b in zip(batches, base_loss)]
                finally:
                    lin.probe = None
                    lin.set_precision(GemmPrecision())
    return out


def update_changes(host: ProbeHost, formats: tuple[str, ...], batches: list[torch.Tensor],
                   gemms: tuple[str, ...] = ("dgrad", "wgrad")) -> dict[tuple[str, str, str], list[float]]:
    """{(linear key, format, g): [ΔW_g per batch]} for each g of ``gemms`` (keys of ``UPDATE_GEMMS``):
    one forward-backward per linear, format, g and batch."""
    params = list(host.model.parameters())
    out = {}
    with all_bf16(host) as linears:
        base = [adam_direction(host.optimizer, params, gradients(host, x)) for x in batches]
        for lin in linears:
            for f in formats:
                for g in gemms:
                    lin.set_precision(UPDATE_GEMMS[g](f))
                    try:
                        out[key_of(lin), f, g] = [
                            float((adam_direction(host.optimizer, params, gradients(host, x)) - u).norm() / u.norm())
                            for x, u in zip(batches, base)]
                    finally:
                        lin.set_precision(GemmPrecision())
    return out


def measure(host: ProbeHost, batches: list[torch.Tensor], formats: tuple[str, ...], step: int) -> dict[str, Any]:
    """The measured divergences of every linear in every format on ``batches``, as a snapshot the
    ``truth`` policy's costs read (``snip.metrics.truth_costs``): per linear and format the sums over
    the batches of ``dl`` (ΔL), ``dw_dgrad`` and ``dw_wgrad`` (ΔW of that GEMM alone)."""
    t0 = time.perf_counter()
    dl = loss_changes(host, formats, batches)
    t1 = time.perf_counter()
    dw = update_changes(host, formats, batches)
    t2 = time.perf_counter()
    linears = {
        key_of(lin): {f: {"dl": sum(dl[key_of(lin), f]), "dw_dgrad": sum(dw[key_of(lin), f, "dgrad"]),
                          "dw_wgrad": sum(dw[key_of(lin), f, "wgrad"])} for f in formats}
        for lin in host.model.precision_linears()}
    return {"step": step, "kind": "truth", "formats": list(formats), "num_batches": len(batches),
            "linears": linears, "timings": {"truth_loss_s": t1 - t0, "truth_update_s": t2 - t1}}
