"""Costs across re-plans: remembered (``snip.cost_ema``, an exponential moving average) and the
forward GEMMs' formats kept (``snip.forward_stickiness``, ``kept_forward`` below).

One re-plan's costs follow its few probe batches, and plans made from slightly different statistics
share few of their protected GEMMs (docs/results/preconditioner/results.md), so part of what moves
a plan from one re-plan to the next is the probe's noise, not the model. (At 6.46M the average
settled the plans without moving the loss: docs/results/cost_ema/results.md.) With ``cost_ema = β > 0``
the k-th applied plan is solved from

    c̄_k = β · c̄_(k-1) + (1 − β) · c_k,        c̄_1 = c_1,

per GEMM and format, where c_k are that re-plan's costs (``policies.policy_costs``: fractions of
their whole-model total, so re-plans of different gradient scale weigh alike). β is the weight of
the past: re-plan k − j enters with β^j (1 − β), and the costs of about 1 / (1 − β) re-plans
carry a plan. The first re-plan, and one whose GEMMs or formats differ from the memory's (a
changed candidate set), starts a new memory from its own costs.

The memory holds the costs of the plans applied so far (a failed or timed-out solve leaves it as
it was, as it leaves the plan). It lives on global rank 0, which solves, and is checkpointed with
the controller's state as JSON-like ``{"<layer>.<linear>.<gemm>": {format: cost}}``, which
``from_state`` reads back to the same floats (a resumed run plans the same).

The kept forward formats need no state of their own: the plan in force is the one the trainer
checkpoints and restores, so a resumed run discounts the same costs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megatron_snip.precision.plan import GemmId

Costs = Mapping[GemmId, Mapping[str, float]]


def kept_forward(costs: Costs, in_force: Mapping[GemmId, str], stickiness: float) -> dict[GemmId, dict[str, float]]:
    """The costs a plan is solved from under ``snip.forward_stickiness = k``: each fprop GEMM's cost in
    the format it runs in under the plan in force (``in_force``: GemmId -> format) times ``1 − k``; every
    other cost as it is, and an infinite one stays so (a format not allowed stays not allowed). A copy:
    ``costs`` itself is never changed.

    Why: the weights adapt to the quantization error of the forward GEMMs they train with. Re-evaluated
    in another arm's last plan, each arm's final weights pay more for that plan's FP4 forward GEMMs than
    the weights that trained in it (1.66M, development bases: NVIDIA's recipe's last plan costs its own
    weights 0.0062 ± 0.0010 less than it costs SNIP's; docs/results/forward_split/results.md, "Each last
    plan on the other arms' weights"). The statistics are measured on the current weights against BF16, so they
    price a forward GEMM's error the same whether the weights adapted to it or not; a discount on
    staying is the adaptation a change of format would give up. ``k = 0`` is SNIP as measured (the
    default), ``k = 1`` makes staying free, so a forward GEMM changes format only where the backward
    GEMMs or the FP4 floor pay for it. Backward GEMMs are left alone: their errors move the updates,
    not the function the weights adapt to. A format the plan in force uses that is not priced (BF16
    in force before the first plan, when BF16 is no candidate) gets no discount. Tried in training at
    1.66M it ties shipped SNIP (docs/results/kept_forward/results.md): the default stays 0."""
    if not 0.0 <= stickiness <= 1.0:
        raise ValueError(f"forward_stickiness={stickiness} must be in [0, 1]")
    out = {g: dict(per_f) for g, per_f in costs.items()}
    for g, per_f in out.items():
        f = in_force.get(g)
        if g.gemm == "fprop" and f in per_f and math.isfinite(per_f[f]) and stickiness > 0:
            per_f[f] *= 1.0 - stickiness
    return out


def same_units(a: Costs, b: Costs) -> bool:
    """Whether two cost tables price the same GEMMs in the same formats."""
    return a.keys() == b.keys() and all(a[g].keys() == b[g].keys() for g in a)


def smoothed(current: Costs, memory: Costs | None, beta: float) -> dict[GemmId, dict[str, float]]:
    """β · memory + (1 − β) · current, per GEMM and format; ``current`` itself (a copy) without a
    memory, at β = 0, or when the two tables do not price the same units (``same_units``)."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"cost_ema={beta} must be in [0, 1)")
    if memory is None or beta == 0.0 or not same_units(current, memory):
        return {g: dict(per_f) for g, per_f in current.items()}
    return {g: {f: beta * memory[g][f] + (1.0 - beta) * c for f, c in per_f.items()} for g, per_f in current.items()}


def to_state(costs: Costs) -> dict[str, dict[str, float]]:
    """The checkpointed form: ``{"<layer>.<linear>.<gemm>": {format: cost}}`` (plain floats)."""
    return {g.key: {f: float(c) for f, c in per_f.items()} for g, per_f in costs.items()}


def from_state(state: Mapping[str, Any] | None) -> dict[GemmId, dict[str, float]] | None:
    """``to_state``'s inverse; None for no memory. TypeError for a state that is not a mapping, ValueError
    naming the entry for a malformed one (a checkpoint's controller state is data: nothing in it is executed)."""
    if state is None:
        return None
    if not isinstance(state, Mapping):
        raise TypeError(f"the checkpointed cost memory is {type(state).__name__}, not a mapping of GEMM keys")
    out: dict[GemmId, dict[str, float]] = {}
    for key, per_f in state.items():
        if not isinstance(per_f, Mapping) or not all(isinstance(c, (int, float)) for c in per_f.values()):
            raise ValueError(f"the checkpointed cost memory's entry {key!r} is {per_f!r}, not {{format: cost}}")
        out[GemmId.parse(key)] = {str(f): float(c) for f, c in per_f.items()}
    return out
