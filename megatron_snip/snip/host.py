"""The seam between SNIP and the training loop that hosts it.

SNIP never sees a trainer: ``snip/stats.py`` runs its probe passes on a ``ProbeHost`` (the model's
precision linears, the optimizer's state, forward/backward), and ``snip/controller.py`` re-plans on
a ``SnipHost`` (a ``ProbeHost`` that also hands out training data, holds the plan in force, applies
a plan and records a re-plan). ``training.trainer.Trainer`` is the host; tests host SNIP on small
stand-ins. A re-plan is a value (``Replan``) that the host records in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from megatron_snip.model.layers import PrecisionLinear
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.precision.plan import GemmId, PrecisionPlan


class ProbeModel(Protocol):
    """This rank's piece of the model as the probes see it."""

    def precision_linears(self) -> Iterable[PrecisionLinear]:
        """The linears of this stage whose GEMMs a plan sets (qkv, proj, fc1, fc2 of each block)."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


class TokenSource(Protocol):
    """The training stream: ``batch(start, n)`` -> sequences [start, start + n), (n, S+1) int64 on CPU."""

    def batch(self, start_sample: int, batch_size: int) -> torch.Tensor: ...


@runtime_checkable
class ProbeHost(Protocol):
    """What the statistics passes (``StatsCollector.collect``) need.

    ``forward_backward`` accumulates parameter gradients of the mean loss over a list of
    (B, S+1) micro-batches through this rank's pipeline stage (the layout's schedule; its
    collectives run over ``topo``'s groups) and returns the detached loss; ``forward_loss`` is the
    whole model's loss of one micro-batch with its graph (one pipeline stage only). ``optimizer``
    is the AdamW whose state (``exp_avg_sq``) preconditions the weight divergences.
    """

    @property
    def model(self) -> ProbeModel: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def topo(self) -> ParallelTopology: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def num_layers(self) -> int:
        """Transformer blocks of the whole model (every stage walks all of them in the same order)."""
        ...

    def forward_backward(self, micro: list[torch.Tensor]) -> torch.Tensor: ...

    def forward_loss(self, tokens: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ReferencePass:
    """The statistics' reference pass handed to the training step it was run for (``snip.reuse_step``).

    The reference pass runs every linear in BF16 on the probe micro-batches at the step's weights;
    its first ``micro_batches`` probe batches are the step's own first micro-batches (the same
    tokens), so the step takes their gradients from it instead of running them again.

    Attributes:
        step: the optimizer step it belongs to (the re-plan step).
        micro_batches: k, how many of the step's micro-batches (its first k) it covers.
        grads: (parameter, gradient) pairs of this rank: the sum over those k micro-batches of the
            gradient of each one's mean loss, before any reduction over TP (sequence parallel) or DP;
            parameters that got no gradient are absent.
        losses: the k micro-batches' mean losses (0-d fp32 on the device, detached), in order.
    """

    step: int
    micro_batches: int
    grads: list[tuple[torch.nn.Parameter, torch.Tensor]]
    losses: list[torch.Tensor]


class Logger(Protocol):
    """The host's rank-0 text log."""

    def info(self, message: str) -> None: ...


@runtime_checkable
class SnipHost(ProbeHost, Protocol):
    """What the re-planning controller needs besides the probes.

    ``plan`` is the plan in force; ``apply_plan`` switches every linear to a plan (every rank, at a
    step boundary, nothing recorded); ``record_replan`` records a re-plan's outcome (plan JSON,
    statistics snapshot, precision map, metrics, W&B, checkpointed state) and
    ``record_plan_summary`` the end-of-run plots. ``micro_batches`` and ``reuse_reference`` let the
    re-plan step's training step take the gradients of the statistics' reference pass
    (``snip.reuse_step``). ``train_data`` is where probe batches come from, ``load_batch`` takes them to
    the device. ``plan_history`` is every plan in force so far, in order (checkpointed with the run).
    ``extra_state`` is the callbacks' checkpointed state (restored on resume; ``record_replan``
    keeps the controller's under ``"snip"``); ``logger`` the text log.
    """

    @property
    def extra_state(self) -> dict[str, Any]: ...

    @property
    def logger(self) -> Logger: ...

    @property
    def plan(self) -> PrecisionPlan: ...

    @property
    def plan_history(self) -> list[PrecisionPlan]:
        """Every plan put in force so far, in order (the initial one first; each in force from its
        ``step`` until the next one's), as checkpointed: a run-level FP4 budget
        (``snip/budget.py``) derives what it has spent from it, so a resumed run derives the same."""
        ...

    @property
    def train_data(self) -> TokenSource: ...

    def micro_batches(self, step: int, on_host: bool = False) -> list[torch.Tensor]:
        """This rank's micro-batches of optimizer step ``step``, each (B, S+1): where its stage
        reads them (the device), or on the host (``on_host``: compared without a device read)."""
        ...

    def load_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """A host batch (B, S+1) where this rank's stage reads it: on the device, pinned and
        non-blocking on CUDA; left on the host on a middle pipeline stage (it reads no tokens)."""
        ...

    def reuse_reference(self, reference: ReferencePass) -> None:
        """Hand the re-plan's reference pass to the training step ``reference.step`` (which then
        runs only its micro-batches after the first ``reference.micro_batches``)."""
        ...

    def apply_plan(self, plan: PrecisionPlan) -> None: ...

    def record_replan(self, replan: Replan) -> None: ...

    def record_plan_summary(self) -> None: ...


@dataclass(frozen=True)
class Replan:
    """The outcome of one re-plan, the same on every rank except ``snapshot`` and ``timings``'
    statistics entries (measured per rank, reduced to the whole model).

    Attributes:
        step: the step boundary it ran at.
        plan: the plan in force afterwards (the previous one when ``kept`` says why).
        kept: None when ``plan`` is new and applied; else why the previous plan stays
            (e.g. "solve failed (...); keeping the previous plan <hash>").
        snapshot: the whole-model statistics snapshot (``snip/stats.py``); None for policies
            that need none.
        timings: seconds per phase (stats_*, metrics_s, solve_s, broadcast_s - on ranks other than 0
            it includes waiting for rank 0's metrics and solve -, apply_s, replan_total_s).
        predicted_divergence: the costs' total for ``plan`` (ILP policies), else None.
        gemms_changed: GEMMs whose format differs from the previous plan.
        count: plans applied by this controller so far, this one included.
        costs: the per-GEMM costs the plan was solved from (``costs[GemmId][format]``), on
            global rank 0 only (None elsewhere, and for policies without costs).
        reused_micro_batches: micro-batches of this step whose gradients the training step takes
            from the statistics' reference pass (``snip.reuse_step``; this rank's, 0 without reuse).
        controller_state: JSON-like entries the controller restores on resume, checkpointed beside
            the re-plan counter in ``extra_state["snip"]`` (the cost memory of ``snip.cost_ema``;
            None: nothing beyond the counter).
    """

    step: int
    plan: PrecisionPlan
    kept: str | None = None
    snapshot: Mapping[str, Any] | None = None
    timings: Mapping[str, float] | None = None
    predicted_divergence: float | None = None
    gemms_changed: int = 0
    count: int = 0
    costs: Mapping[GemmId, Mapping[str, float]] | None = None
    reused_micro_batches: int = 0
    controller_state: Mapping[str, Any] | None = None

    @property
    def applied(self) -> bool:
        return self.kept is None
