"""Batches reach the device without a host sync (``data/device_batches.py``), modelled on CPU.

The CUDA path runs with a recording stand-in for its torch.cuda calls and ``"meta"`` as the
device (a real host-to-device copy on a CPU-only machine: ``Tensor.to("meta")``). It must pin the
batch, copy the pinned tensor with ``non_blocking=True`` inside the side stream, record an event
there, make the consumer's stream wait on it and mark the tensor used on that stream - and the
host-sync counter, which counts pageable host-to-device copies, must count nothing for it. A
middle pipeline stage copies nothing; the trainer prefetches the next step's batch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.data.device_batches import BatchLoader
from megatron_snip.telemetry.host_syncs import count_host_syncs, syncing_copy
from megatron_snip.training.trainer import Trainer

META = torch.device("meta")


class FakeCuda:
    """Records the CUDA calls ``BatchLoader`` makes, in order, and which tensors it pinned."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.pinned: set[int] = set()
        self.in_copy_stream = False
        self.side, self.main = object(), object()

    def copy_stream(self):
        return self.side

    @contextlib.contextmanager
    def stream(self, s):
        assert s is self.side
        self.in_copy_stream = True
        try:
            yield
        finally:
            self.in_copy_stream = False

    def event(self):
        fake = self

        class Event:
            def record(self, stream):
                fake.calls.append(("record", stream))

        return Event()

    def current_stream(self):
        fake = self

        class Current:
            def wait_event(self, event):
                fake.calls.append(("wait_event",))

        return Current()

    def pin(self, t):
        out = t.clone()
        self.pinned.add(id(out))
        self.calls.append(("pin", t.shape))
        return out

    def record_stream(self, t, s):
        self.calls.append(("record_stream", t.device.type))


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    original_to, original_pinned = torch.Tensor.to, torch.Tensor.is_pinned

    def to(self, *args, **kwargs):
        if args and torch.device(args[0]) == META:
            fake.calls.append(("to", id(self) in fake.pinned, kwargs.get("non_blocking", False), fake.in_copy_stream))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: id(self) in fake.pinned or original_pinned(self))
    return fake


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(seed))


def test_the_cuda_path_pins_copies_non_blocking_on_a_side_stream_and_syncs_nothing(fake_cuda):
    loader = BatchLoader(META, cuda_api=fake_cuda)
    assert loader.pinned
    with count_host_syncs() as syncs:
        out = loader.load(_batch())
    assert out.device == META and out.shape == (4, 9)
    assert fake_cuda.calls == [("pin", (4, 9)), ("to", True, True, True), ("record", fake_cuda.side),
                               ("wait_event",), ("record_stream", "meta")]
    assert syncs.count == 0, syncs.where


def test_a_pageable_copy_is_counted_as_a_sync():
    plain = BatchLoader(META)  # a device without the pinned path: what the trainer did before on CUDA
    with count_host_syncs() as syncs:
        plain.load(_batch())
    assert syncs.kinds == ["pageable_copy"] and syncs.where[0].startswith("device_batches.py:")


def test_syncing_copy_is_the_cuda_rule():
    class Pinned:
        device = torch.device("cpu")

        def is_pinned(self):
            return True

    t = torch.zeros(2)
    assert syncing_copy(t, torch.device("cuda"), True)  # pageable: staged, the host waits
    assert syncing_copy(Pinned(), torch.device("cuda"), False)  # pinned but blocking: cudaMemcpy waits
    assert not syncing_copy(Pinned(), torch.device("cuda"), True)
    assert not syncing_copy(t, torch.device("cpu"), False)  # host to host
    assert not syncing_copy(torch.zeros(2, device="meta"), torch.device("cpu"), False)  # not host to device


def test_a_middle_stage_loads_nothing(fake_cuda):
    loader = BatchLoader(META, needs_tokens=False, cuda_api=fake_cuda)
    batch = _batch()
    assert loader.load(batch) is batch
    loader.prefetch(1, _batch)
    assert loader.take(1, _batch).device.type == "cpu"
    assert list(loader.ahead([batch, batch])) == [batch, batch]
    assert fake_cuda.calls == []


def test_take_uses_the_prefetched_batch_and_drops_a_stale_one(fake_cuda):
    loader = BatchLoader(META, cuda_api=fake_cuda)
    fetched = []

    def fetch(seed):
        fetched.append(seed)
        return _batch(seed)

    loader.prefetch(1, lambda: fetch(1))
    assert fake_cuda.calls[:2] == [("pin", (4, 9)), ("to", True, True, True)]  # started at once
    loader.take(1, lambda: fetch(99))
    assert fetched == [1]  # the prefetched copy, not a new one
    loader.prefetch(2, lambda: fetch(2))
    loader.take(3, lambda: fetch(3))  # another step (e.g. after a resume): copied now
    assert fetched == [1, 2, 3]


def test_ahead_starts_the_next_copy_before_yielding(fake_cuda):
    loader = BatchLoader(META, cuda_api=fake_cuda)
    batches = [_batch(i) for i in range(3)]
    seen = []
    for out in loader.ahead(batches):
        seen.append((out.shape, sum(c[0] == "to" for c in fake_cuda.calls)))
    assert seen == [((4, 9), 2), ((4, 9), 3), ((4, 9), 3)]


def test_cpu_loader_is_the_identity():
    loader = BatchLoader(torch.device("cpu"))
    batch = _batch()
    assert not loader.pinned and loader.load(batch) is batch


def test_the_trainer_prefetches_the_next_step(tmp_path):
    cfg = load_config("launch/configs/tiny.toml", [
        f"training.run_dir={tmp_path}/run", "training.max_steps=2", "training.progress=false",
        "model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=2",
        "model.num_kv_heads=1", "training.seq_len=32", "training.micro_batch_size=2",
        "training.global_batch_size=4", "snip.enabled=false", "precision.initial_plan=bf16",
        "precision.compile_quantizers=false"])
    tr = Trainer(cfg)
    assert tr.batches.needs_tokens  # one stage: first and last
    tr.train_step(0)
    key, ahead = tr.batches._ahead
    assert key == 1 and torch.equal(ahead, tr._rank_batch(1))
    assert [torch.equal(a, b) for a, b in zip(tr.micro_batches(1), tr.micro_batches(1, on_host=True))] == [True, True]
    tr.train_step(1)
    assert tr.batches._ahead is None  # the last step prefetches nothing
