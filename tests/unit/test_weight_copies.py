"""One BF16 weight copy per step (precision/weight_copies.py): the micro-batches of a step share
each linear's and the LM head's autocast copy instead of making one each, and training is bitwise
what it was with a copy per micro-batch (same rounding of the same fp32 weight, gradients through
the same cast, accumulated in the same order)."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL

from megatron_snip.config import load_config
from megatron_snip.precision.weight_copies import WeightCopy
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
# bf16 autocast, BF16 plan (the reference path), 2 micro-batches per step.
OVER = ["training.dtype=bfloat16", "training.micro_batch_size=2", "training.global_batch_size=4",
        "training.seq_len=48"]  # T = 96 tokens per micro-batch: no activation has a weight's shape


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(load_config(TINY, SMALL + OVER + [f"training.run_dir={tmp_path / name}",
                                                     f"data.cache_dir={tmp_path / 'cache'}", *extra]))


def _saved_copies(tr: Trainer) -> list[int]:
    """Storages of BF16 weight-shaped tensors saved for backward during one step's forward/backward
    (one entry per save, so a copy shared by two micro-batches appears twice). The tensors are kept
    alive until the end, so a freed copy's memory cannot come back as another copy's."""
    shapes = {s for p in tr.model.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.t().shape))}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tr.forward_backward(tr.micro_batches(0))
    return [t.untyped_storage().data_ptr() for t in saved]


def _train(tr: Trainer, steps: int = 2) -> dict:
    losses = []
    for s in range(steps):
        losses.append(tr.train_step(s).loss)
        tr.step = s + 1
    tr.logger.close()
    return {"losses": losses, "params": [p.detach().clone() for p in tr.model.parameters()]}


def test_micro_batches_share_one_copy_per_weight(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, "shared")
    shared = _saved_copies(tr)
    weights = 4 * 2 + 1  # four linears in each of 2 blocks, and the LM head
    assert len(shared) == 2 * weights and len(set(shared)) == weights  # each saved by both micro-batches
    assert all(c._copy is None for c in (*(lin.weight_copy for lin in tr.model.precision_linears()),
                                         tr.model.lm_head.weight_copy)), "the step's copies are dropped"
    monkeypatch.setattr(WeightCopy, "open", lambda self: None)  # a copy per micro-batch, as autocast makes
    tr.optimizer.zero_grad(set_to_none=True)
    per_micro = _saved_copies(tr)
    assert len(per_micro) == len(set(per_micro)) == 2 * weights


def test_training_is_bitwise_that_with_a_copy_per_micro_batch(tmp_path, monkeypatch):
    shared = _train(_trainer(tmp_path, "shared"))
    monkeypatch.setattr(WeightCopy, "open", lambda self: None)
    per_micro = _train(_trainer(tmp_path, "per_micro"))
    assert shared["losses"] == per_micro["losses"]
    assert all(torch.equal(a, b) for a, b in zip(shared["params"], per_micro["params"], strict=True))


def test_full_recompute_keeps_no_copy_between_passes(tmp_path):
    tr = _trainer(tmp_path, "full", "training.recompute=full")
    assert not any(lin.weight_copy.enabled for lin in tr.model.precision_linears())
    tr.forward_backward(tr.micro_batches(0))  # runs; the LM head (not recomputed) still shares its copy


@pytest.mark.parametrize("grad", [True, False])
def test_a_copy_follows_the_weight(grad):
    w = torch.randn(8, 4, requires_grad=True)
    c = WeightCopy()
    assert c.get(w, torch.float32) is w
    assert c.get(w, torch.bfloat16) is not c.get(w, torch.bfloat16), "no scope: a fresh cast each call"
    c.open()
    with torch.set_grad_enabled(grad):
        first = c.get(w, torch.bfloat16)
        assert (c.get(w, torch.bfloat16) is first) == grad  # cached only where a graph will hold it
        with torch.no_grad():
            w.add_(1.0)  # an in-place update inside the scope: the version moves, the copy is re-made
        again = c.get(w, torch.bfloat16)
        assert again is not first and torch.equal(again, w.detach().to(torch.bfloat16))
    c.close()
    assert c._copy is None
