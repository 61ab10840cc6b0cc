"""A re-plan step's training step taking the gradients of SNIP's reference pass (``snip.reuse_step``).

At a re-plan step the statistics' reference pass (``snip/stats.py``, pass 1) runs every linear in
BF16 on the probe micro-batches at the step's weights. When the step's first k micro-batches are
those probe batches (the same tokens), the step takes their gradients and losses from it
(``snip.host.ReferencePass``) and runs only its other micro-batches: those k micro-batches of that
one step train in BF16, whatever the plan, and the re-plan costs k forward/backward passes less.

Exactness: the reference pass ran each micro-batch alone (its mean loss), the step divides each
micro-batch's loss by the step's M micro-batches. Dividing the kept sums by M gives the gradients
the step would have accumulated, bit for bit when M is a power of two (a power-of-two scale
commutes with every rounding); otherwise within one rounding per element.
"""

from __future__ import annotations

import torch

from megatron_snip.snip.host import ReferencePass


def take_reference(reference: ReferencePass | None, step: int, micro_batches: int) -> int:
    """Install ``reference``'s gradients as the ``.grad`` of its parameters, scaled to the step's
    mean over ``micro_batches`` (M); returns how many of the step's first micro-batches it covers
    (0 when there is none for this ``step``: ``.grad`` is then left alone). Call after zeroing the
    gradients and before the step's own backward passes, which accumulate onto these."""
    if reference is None or reference.step != step:
        return 0
    if not 0 < reference.micro_batches <= micro_batches:
        raise RuntimeError(f"step {step}: the re-plan's reference pass covers {reference.micro_batches} "
                           f"micro-batches, the step has {micro_batches}")
    for param, grad in reference.grads:
        param.grad = grad if micro_batches == 1 else grad / micro_batches
    return reference.micro_batches


def reused_loss(reference: ReferencePass, micro_batches: int) -> torch.Tensor:
    """The reused micro-batches' share of the step's mean loss (0-d fp32): each loss over M, summed
    in micro-batch order from zero, as the schedules sum theirs."""
    total = torch.zeros((), dtype=torch.float32, device=reference.losses[0].device)
    for loss in reference.losses:
        total = total + loss.float() / micro_batches
    return total
