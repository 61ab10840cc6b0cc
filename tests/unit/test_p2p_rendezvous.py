"""The pipeline schedules under NCCL's point-to-point semantics (tests/unit/nccl_model.py), which the
gloo tests cannot show: a send waits for the peer's receive, a pair's ops run in posting order.

The posting order the pipeline used before (every isend, then every irecv, as separate ops)
deadlocks there in 1F1B's steady state at pp=2 and pp=4, while gloo-like buffered sends complete;
``comm.exchange`` (one batch_isend_irecv per exchange) completes, with the same bits as the old
order under buffered sends: p2p only moves bytes, so the loss and every gradient are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from nccl_model import Deadlock, RendezvousWorld

from megatron_snip.parallel import comm
from megatron_snip.parallel.pipeline import run_schedule
from megatron_snip.parallel.topology import ParallelTopology

B, S, D = 2, 3, 8  # activation (B, S, D) sent between stages


def isends_then_irecvs(sends, recvs, group) -> None:
    """The exchange the pipeline used until the NCCL fix: every isend, then every irecv, then wait."""
    dist = comm.dist  # the model, as installed by the test
    works = [dist.isend(t.contiguous(), dst=dst, group=group) for t, dst in sends]
    works += [dist.irecv(buf, src=src, group=group) for buf, src in recvs]
    for w in works:
        w.wait()


def _stage(rank: int, pp: int, num_micro: int, schedule: str, forward_only: bool, group) -> tuple:
    """Stage ``rank`` of a pp-stage chain of tanh(Linear) blocks; last stage: mean square loss / M."""
    gen = torch.Generator().manual_seed(100 + rank)  # this stage's weights, the same in every run (no global RNG:
    lin = torch.nn.Linear(D, D)                       # the ranks are threads of one process)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(D, D, generator=gen) / D**0.5)
        lin.bias.copy_(torch.randn(D, generator=gen) / 10)
    inputs = torch.randn(num_micro, B, S, D, generator=torch.Generator().manual_seed(7))
    topo = ParallelTopology.from_rank(pp, rank, tp=1, pp=pp, pp_group=group)

    def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor:
        y = torch.tanh(lin(inputs[i] if x is None else x))
        return y.pow(2).mean() / num_micro if topo.is_last_stage else y

    total = run_schedule(forward_step, num_micro, topo, activation_shape=(B, S, D), dtype=torch.float32,
                         device=torch.device("cpu"), schedule=schedule, forward_only=forward_only)
    return total, [p.grad for p in lin.parameters()]


def _run(monkeypatch, pp: int, *, buffered: bool, old_order: bool, num_micro: int = 6, schedule: str = "1f1b",
         forward_only: bool = False) -> list[tuple]:
    world = RendezvousWorld(pp, buffered=buffered)
    monkeypatch.setattr(comm, "dist", world)
    if old_order:
        monkeypatch.setattr(comm, "exchange", isends_then_irecvs)
    try:
        return world.run(lambda rank, group: _stage(rank, pp, num_micro, schedule, forward_only, group))
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("pp", [2, 4])
def test_isends_then_irecvs_deadlocks_1f1b_under_nccl_semantics(monkeypatch, pp):
    # The model's power to tell: the old posting order completes with buffered (gloo) sends ...
    _run(monkeypatch, pp, buffered=True, old_order=True)
    # ... and deadlocks once a send waits for its receive (6 micro-batches: steady state on every stage).
    with pytest.raises(Deadlock, match="send to"):
        _run(monkeypatch, pp, buffered=False, old_order=True)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule,forward_only", [("1f1b", False), ("gpipe", False), ("1f1b", True)])
def test_batched_exchange_completes_with_the_old_bits(monkeypatch, pp, schedule, forward_only):
    ref = _run(monkeypatch, pp, buffered=True, old_order=True, schedule=schedule, forward_only=forward_only)
    got = _run(monkeypatch, pp, buffered=False, old_order=False, schedule=schedule, forward_only=forward_only)
    for stage, ((t_ref, g_ref), (t, g)) in enumerate(zip(ref, got)):
        assert torch.equal(t, t_ref), f"stage {stage}: loss {t} vs {t_ref}"
        assert t.item() > 0  # the last stage's losses reached every stage (the broadcast ran)
        if forward_only:
            assert all(x is None for x in g)
        else:
            assert all(torch.equal(a, b) for a, b in zip(g, g_ref)), f"stage {stage}: gradients differ"
            assert all(a.abs().sum() > 0 for a in g)


def test_exchange_refuses_a_buffer_off_the_groups_device(monkeypatch):
    """The device rule holds for p2p too: a CPU buffer on a group bound to another device is refused
    before anything is posted (the model's group runs on ``meta`` here)."""
    world = RendezvousWorld(2, device="meta")
    monkeypatch.setattr(comm, "dist", world)

    def rank_fn(rank, group):
        with pytest.raises(RuntimeError, match=r"exchange \(send\): a tensor on cpu .* group runs on meta"):
            comm.exchange([(torch.zeros(3), 1 - rank)], [], group)
        return True

    assert world.run(rank_fn) == [True, True]
