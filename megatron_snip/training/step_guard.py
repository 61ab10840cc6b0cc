"""The optimizer step's guards, decided on the device and read by the host once per log interval.

A step's outcome stays on the device (``StepResult``: 0-d fp32 tensors): the DP-mean loss, the
gradient norm, the skip flag (a non-finite loss or norm on any rank), the parameter norms around
the update and the post-step guard's flag (a ruinous update), and the stop flag (a preemption
signal on any rank). The skip flag and the stop flag are reduced together, one 2-element max
all-reduce over the world group, before the optimizer step.

* **Skip on the device.** ``optimizer_step`` hands the skip flag to a fused AdamW as its
  ``found_inf`` (torch's fused kernel, as ``torch.amp.GradScaler`` does; Megatron's found-inf):
  the kernel leaves weights, moments and the step count untouched when it is 1 (``build_optimizer``
  takes that kernel on CUDA). Optimizers without that input (the foreach AdamW on CPU) read the
  flag on the host: the one host read a step then makes, because the guard must decide before the update.
* **Read once per interval.** ``StepLedger`` keeps the steps since the last read and reads them
  all with one ``tolist()`` at the trainer's read points (log, eval and save steps, the last
  step). Only then are skipped steps counted and logged, and ``TrainingStopped`` raised for a run
  of non-finite steps or a ruinous update - always before a checkpoint is written, so no
  checkpoint ever holds the weights a guard refused.
* **Stops one step late, not one interval late.** ``LaggedFlags`` copies each step's stop flag
  and post-step guard flag to the host without waiting (CUDA: into pinned memory, then an event)
  and hands them back at the next step boundary, when the next step's work is queued behind them:
  every rank learns step ``s``'s flags after step ``s + 1`` and acts on them there (a stop, or a
  read that raises the ruinous update), identically, since the flags are the same on every rank.
  Read steps still read everything, the current step included, so a save never waits on the lag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_snip.parallel.distributed_optimizer import DistributedOptimizer


class TrainingStopped(RuntimeError):
    """Raised when the run cannot continue (e.g. too many consecutive non-finite steps)."""


@dataclass
class StepResult:
    """One optimizer step's outcome, each a 0-d fp32 tensor on the model's device, the same on
    every rank. The float properties read one value each (a host sync); the training loop reads
    them all at once through ``StepLedger``.

    Attributes:
        step: the optimizer step (0-based).
        loss_t: mean loss over the global batch (averaged over DP).
        grad_norm_t: global gradient norm before clipping.
        skipped_t: 1 when the NaN/Inf guard skipped the update (on any rank), else 0.
        stop_t: 1 when some rank had received a stop signal when the flags were reduced.
        norm_before_t / norm_after_t: parameter norms before and after the update.
        bad_update_t: 1 when the post-step guard refused the update (see ``update_refused``).
    """

    step: int
    loss_t: torch.Tensor
    grad_norm_t: torch.Tensor
    skipped_t: torch.Tensor
    stop_t: torch.Tensor
    norm_before_t: torch.Tensor
    norm_after_t: torch.Tensor
    bad_update_t: torch.Tensor

    @property
    def loss(self) -> float:
        return float(self.loss_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t)

    @property
    def skipped(self) -> bool:
        return bool(self.skipped_t > 0)

    def values(self) -> torch.Tensor:
        """The seven values as one fp32 vector on the device, in ``StepRecord``'s field order."""
        return torch.stack([self.loss_t, self.grad_norm_t, self.skipped_t, self.stop_t, self.norm_before_t,
                            self.norm_after_t, self.bad_update_t]).float()


@dataclass
class StepRecord:
    """A ``StepResult`` read on the host, plus what the loop knew of the step there."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    stop: bool
    norm_before: float
    norm_after: float
    bad_update: bool
    dt: float  # wall seconds of the step as the host saw it
    host: dict[str, Any]  # the loop's own per-step values (e.g. the plan's FP4 share)


def update_refused(norm_before: torch.Tensor, norm_after: torch.Tensor, skipped: torch.Tensor,
                   growth: float) -> torch.Tensor:
    """The post-step guard on the device (1.0 = refused): a finite loss and grad norm can still
    give a ruinous update (a huge LR, an FP4 outlier through Adam's 1/sqrt(v)). Refused when the
    parameter norm became non-finite or grew more than ``growth`` times (0 = no growth limit); a
    skipped step changed nothing and is never refused. Compared in float64, as the host did."""
    after = norm_after.double()
    bad = ~torch.isfinite(after)
    if growth:
        bad = bad | (after > growth * norm_before.double())
    return (bad & (skipped <= 0)).float()


def takes_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` can skip on a device flag: torch's fused Adam/AdamW (its kernel
    reads ``optimizer.found_inf``) and the ZeRO-1 optimizer built on that kernel."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.fused
    return isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)


def optimizer_step(optimizer: Any, skip: torch.Tensor) -> None:
    """Step ``optimizer`` unless ``skip`` (0-d fp32 on the device, 1 = skip) says otherwise,
    deciding on the device when the optimizer can (``takes_found_inf``), else on the host."""
    if takes_found_inf(optimizer):
        optimizer.found_inf = skip
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None
        return
    if skip.item() > 0:  # the one read a step needs when the optimizer cannot skip on the device
        optimizer.zero_grad(set_to_none=True)
        return
    optimizer.step()


class StepLedger:
    """The steps since the last read (``add``), read all at once (``read``: one host sync)."""

    def __init__(self) -> None:
        self._pending: list[tuple[StepResult, float, dict[str, Any]]] = []

    def add(self, res: StepResult, dt: float, **host: Any) -> None:
        self._pending.append((res, dt, host))

    def read(self) -> list[StepRecord]:
        if not self._pending:
            return []
        rows = torch.stack([res.values() for res, _, _ in self._pending]).tolist()
        out = [StepRecord(res.step, row[0], row[1], row[2] > 0, row[3] > 0, row[4], row[5], row[6] > 0, dt, host)
               for (res, dt, host), row in zip(self._pending, rows)]
        self._pending = []
        return out


class LogWindow:
    """Steps since the last log line, as their records are read: summed loss of the non-skipped ones
    and wall time (the log line's mean loss and throughput)."""

    def __init__(self) -> None:
        self.steps, self.seconds, self.loss_sum, self.loss_count = 0, 0.0, 0.0, 0

    def add(self, rec: StepRecord) -> None:
        self.steps += 1
        self.seconds += rec.dt
        if not rec.skipped:
            self.loss_sum += rec.loss
            self.loss_count += 1

    def mean_loss(self) -> float:
        return self.loss_sum / self.loss_count if self.loss_count else math.nan


def non_finite_stop(consecutive: int, limit: int, step: int) -> TrainingStopped:
    """The error for ``consecutive`` non-finite steps in a row ending at ``step``."""
    return TrainingStopped(
        f"{consecutive} consecutive non-finite steps (training.max_consecutive_skips={limit}) at step {step}; "
        f"weights are those of the last good step. Lower training.lr, raise precision (e.g. "
        f"precision.initial_plan=bf16) or check the data")


def ruinous_update_stop(rec: StepRecord, growth: float, lr: float, last_checkpoint: str) -> TrainingStopped:
    """The error for the update of ``rec`` that the post-step guard refused; ``last_checkpoint``
    says which checkpoint holds good weights."""
    return TrainingStopped(
        f"step {rec.step}: the optimizer update took the parameter norm from {rec.norm_before:.4g} to "
        f"{rec.norm_after:.4g} (more than training.max_param_norm_growth={growth} times, or non-finite); stopped "
        f"before these weights were saved - {last_checkpoint} holds good weights. Lower training.lr (now {lr}) "
        f"or raise precision, then resume with training.resume=auto")


@dataclass(frozen=True)
class LateFlags:
    """Step ``step``'s stop flag and post-step guard flag (``StepResult.stop_t``,
    ``bad_update_t``), read on the host one step later by ``LaggedFlags``."""

    step: int
    stop: bool
    refused: bool


class LaggedFlags:
    """Each step's stop and refused flags on the host a step later, without draining the stream.

    ``exchange(res)`` starts the copy of ``res``'s two flags (2 fp32) into a host buffer and
    returns the flags of the step posted before it (``None`` at the first call). On CUDA the
    buffer is pinned, the copy ``non_blocking`` on the current stream (which the flag all-reduce
    and the parameter-norm kernels precede) and an event is recorded after it; the read waits on
    that event alone (``Event.synchronize``), not on the stream, so the step queued since runs on:
    in practice the event has long completed. Elsewhere the copy is a plain one. Two buffers
    alternate: step ``s``'s copy may land before step ``s - 1``'s buffer is read. The read goes
    through the buffer's numpy view: host memory, not a read of a device tensor; on CUDA
    ``telemetry.host_syncs`` counts the event wait as an ``"event_sync"`` (a wait, if for work long done).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._buffers = [torch.zeros(2, pin_memory=self._cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if self._cuda else None for _ in range(2)]
        self._posted: tuple[int, int] | None = None  # (step, buffer index) of the unread copy

    def _start_copy(self, slot: int, flags: torch.Tensor) -> None:
        self._buffers[slot].copy_(flags, non_blocking=self._cuda)
        if self._cuda:
            self._events[slot].record()

    def _wait(self, slot: int) -> None:
        if self._cuda:
            self._events[slot].synchronize()

    def exchange(self, res: StepResult) -> LateFlags | None:
        previous = self._posted
        slot = 0 if previous is None else 1 - previous[1]
        self._start_copy(slot, torch.stack([res.stop_t, res.bad_update_t]).float())
        self._posted = (res.step, slot)
        if previous is None:
            return None
        step, old = previous
        self._wait(old)
        stop, refused = self._buffers[old].numpy()
        return LateFlags(step, bool(stop > 0), bool(refused > 0))
