"""parallel/comm's device rule where NCCL needs a device named: the barrier (NCCL's is an all-reduce
of one element on a GPU it must be told) and the object broadcast, on a group bound to cuda:3.
No GPU here: a recorder stands in for torch.distributed and shows what comm passes it."""

from __future__ import annotations

import pytest
import torch
from nccl_model import FakeGroup

from megatron_snip.parallel import comm


class _Recorder:
    ReduceOp = torch.distributed.ReduceOp

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group) -> int:
        return len(group.ranks)

    def barrier(self, **kwargs) -> None:
        self.calls.append(("barrier", kwargs))

    def broadcast_object_list(self, box, **kwargs) -> None:
        self.calls.append(("broadcast_object_list", kwargs))

    def all_reduce(self, t, **kwargs) -> None:
        self.calls.append(("all_reduce", kwargs))


def test_barrier_and_object_broadcast_name_the_groups_gpu(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(comm, "dist", rec)
    group = FakeGroup((0, 1), torch.device("cuda", 3))
    comm.barrier(group)
    comm.broadcast_object({"plan": 1}, src=0, group=group)
    assert rec.calls == [("barrier", {"group": group, "device_ids": [3]}),
                         ("broadcast_object_list", {"src": 0, "group": group, "device": torch.device("cuda", 3)})]


def test_a_tensor_off_the_bound_gpu_is_refused_before_any_call(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(comm, "dist", rec)
    group = FakeGroup((0, 1), torch.device("cuda", 3))
    with pytest.raises(RuntimeError, match=r"all_reduce_sum: a tensor on cpu .* runs on cuda:3.*device=topo.device"):
        comm.all_reduce_sum(torch.ones(2), group)
    assert rec.calls == []
