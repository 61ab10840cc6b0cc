"""Schedules over micro-batches: no pipeline, 1F1B (PipeDream-flush, Megatron's default) and GPipe.

``schedule_for(topo, name)`` picks one (Megatron's ``get_forward_backward_func``): with one
pipeline stage the no-pipeline schedule, else the ``parallel.pp_schedule`` named. All share one
interface, so the trainer runs every layout through the same call.

Why not ``torch.distributed.pipelining``: its stages infer shapes by running the module
(on meta tensors or with extra p2p metadata), which collides with the explicit TP
collectives inside our blocks, and it owns loss scaling and micro-batch splitting that the
trainer and the SNIP probes already do. The schedule itself is ~100 lines of p2p; writing it
keeps every stage's behaviour visible and testable (PP=2 vs PP=1 to fp32 reordering).

Each stage calls its schedule with a ``forward_step(i, x)`` closure:
  * first stage: x is None (the closure reads micro-batch i's tokens itself);
  * other stages: x is the received activation (requires grad);
  * returns the stage output: an activation to send on, or on the last stage the micro-batch
    loss already divided by the number of micro-batches (its backward seeds the pipeline).

No pipeline (one stage holds the whole model): forward and backward of each micro-batch in
turn, no communication. 1F1B on stage p of P with M micro-batches: min(P-p-1, M) warm-up forwards, then alternate one
forward and one backward, then the remaining backwards; at most P-p activations are alive.
GPipe = all M forwards, then all M backwards. Activations travel stage p -> p+1 and their
gradients p+1 -> p, between the ranks with the same (tp_rank, dp_rank), over the PP group;
each exchange is one batched send/receive (``comm.exchange``: deadlock-free on NCCL, whose large
sends wait for the peer's receive, as on gloo).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from megatron_snip.parallel import comm
from megatron_snip.parallel.topology import ParallelTopology

ForwardStep = Callable[[int, "torch.Tensor | None"], torch.Tensor]


class Schedule(Protocol):
    """Run ``num_micro`` micro-batches through this stage; returns the detached sum of the last
    stage's losses, the same on every stage (see ``run_schedule`` for the arguments)."""

    def __call__(self, forward_step: ForwardStep, num_micro: int, topo: ParallelTopology, *,
                 activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 forward_only: bool = False) -> torch.Tensor: ...


class _P2P:
    """This stage's links to its neighbours for activations of a fixed shape and dtype."""

    def __init__(self, topo: ParallelTopology, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.topo, self.shape, self.dtype, self.device = topo, shape, dtype, device
        self.prev = None if topo.is_first_stage else topo.stage_rank(topo.pp_rank - 1)
        self.next = None if topo.is_last_stage else topo.stage_rank(topo.pp_rank + 1)

    def _buf(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _run(self, send: list[tuple[torch.Tensor, int]], recv: list[tuple[torch.Tensor, int]]) -> None:
        if send or recv:
            comm.exchange(send, recv, self.topo.pp_group)

    def _check(self, t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) != self.shape:
            raise RuntimeError(f"pipeline stage {self.topo.pp_rank} produced an activation of shape {tuple(t.shape)}, "
                               f"the schedule expects {self.shape}")
        return t.detach().to(self.dtype)

    def recv_forward(self) -> torch.Tensor | None:
        if self.prev is None:
            return None
        x = self._buf()
        self._run([], [(x, self.prev)])
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if self.next is not None:
            self._run([(self._check(y), self.next)], [])

    def recv_backward(self) -> torch.Tensor | None:
        if self.next is None:
            return None
        dy = self._buf()
        self._run([], [(dy, self.next)])
        return dy

    def send_backward(self, dx: torch.Tensor | None) -> None:
        if self.prev is not None:
            assert dx is not None
            self._run([(self._check(dx), self.prev)], [])

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        if self.next is None:
            return None
        dy = self._buf()
        self._run([(self._check(y), self.next)], [(dy, self.next)])
        return dy

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        if self.prev is None:
            return None
        assert dx is not None
        x = self._buf()
        self._run([(self._check(dx), self.prev)], [(x, self.prev)])
        return x.requires_grad_()


def _backward(x: torch.Tensor | None, y: torch.Tensor, dy: torch.Tensor | None) -> torch.Tensor | None:
    """Backward through one stage for one micro-batch; returns dL/dx (None on the first stage)."""
    if dy is None:  # last stage: y is the (scaled) loss
        y.backward()
    else:
        torch.autograd.backward(y, grad_tensors=dy.to(y.dtype))
    return None if x is None else x.grad


def schedule_for(topo: ParallelTopology, name: str) -> Schedule:
    """The schedule of this layout: ``run_no_pipeline`` with one stage, else ``run_schedule`` with
    the ``parallel.pp_schedule`` ``name`` ("1f1b" or "gpipe")."""
    if name not in ("1f1b", "gpipe"):
        raise ValueError(f"config parallel.pp_schedule={name!r}: choose '1f1b' or 'gpipe'")
    if topo.pp == 1:
        return run_no_pipeline

    return functools.partial(run_schedule, schedule=name)


def run_no_pipeline(forward_step: ForwardStep, num_micro: int, topo: ParallelTopology, *,
                    activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                    forward_only: bool = False) -> torch.Tensor:
    """The one-stage schedule: forward (and unless ``forward_only``, backward) of each micro-batch in
    turn; ``forward_step(i, None)`` returns micro-batch i's (scaled) loss. ``activation_shape`` and
    ``dtype`` are unused (nothing travels); no communication, so ``topo`` must have one stage."""
    assert topo.pp == 1, f"the no-pipeline schedule runs one stage, this topology has pp={topo.pp}"
    if num_micro < 1:
        raise ValueError(f"a schedule needs at least one micro-batch, got {num_micro}")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for i in range(num_micro):
        if forward_only:
            with torch.no_grad():
                loss = forward_step(i, None)
        else:
            loss = forward_step(i, None)
            loss.backward()
        total = total + loss.detach().float()
    return total


def run_schedule(forward_step: ForwardStep, num_micro: int, topo: ParallelTopology, *,
                 activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 schedule: str = "1f1b", forward_only: bool = False) -> torch.Tensor:
    """Run ``num_micro`` micro-batches through this pipeline stage (forward and backward).

    Args:
        forward_step: see the module docstring.
        num_micro: micro-batches M (the same on every stage).
        topo: topology; p2p goes over ``topo.pp_group`` to the neighbouring stages.
        activation_shape: shape of the activation sent between stages, e.g. (B, S, D)
            or (B, S/tp, D) under sequence parallelism; ``dtype`` its wire dtype.
        schedule: "1f1b" or "gpipe".
        forward_only: no backward (evaluation): forwards only, nothing kept.

    Returns:
        The sum of the last stage's returned losses (the mean loss when they were divided by
        M), detached, broadcast over the PP group so every stage returns the same value.
    """
    assert schedule in ("1f1b", "gpipe"), f"schedule {schedule!r} (schedule_for checks the name)"
    if num_micro < 1:
        raise ValueError(f"pipeline needs at least one micro-batch, got {num_micro}")
    p2p = _P2P(topo, tuple(activation_shape), dtype, device)
    total = torch.zeros((), dtype=torch.float32, device=device)

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
        nonlocal total
        y = forward_step(i, x)
        if topo.is_last_stage:
            total = total + y.detach().float()
        return y

    if forward_only:
        for i in range(num_micro):
            with torch.no_grad():
                y = fwd(i, p2p.recv_forward())
            p2p.send_forward(y)
    else:
        warmup = num_micro if schedule == "gpipe" else min(topo.pp - topo.pp_rank - 1, num_micro)
        steady = num_micro - warmup
        alive: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        for i in range(warmup):
            x = p2p.recv_forward()
            y = fwd(i, x)
            p2p.send_forward(y)
            alive.append((x, y))
        x = p2p.recv_forward() if steady else None
        for j in range(steady):
            y = fwd(warmup + j, x)
            dy = p2p.send_forward_recv_backward(y)
            alive.append((x, y))
            x_old, y_old = alive.pop(0)
            dx = _backward(x_old, y_old, dy)
            if j == steady - 1:
                p2p.send_backward(dx)
            else:
                x = p2p.send_backward_recv_forward(dx)
        for _ in range(warmup):
            x_old, y_old = alive.pop(0)
            dx = _backward(x_old, y_old, p2p.recv_backward())
            p2p.send_backward(dx)
        assert not alive
    return comm.broadcast_tensor(total, topo.stage_rank(topo.pp - 1), topo.pp_group)
