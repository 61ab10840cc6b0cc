"""Activation recompute (training.recompute) changes memory, never numbers: on CPU the losses,
the SNIP statistics and the plans of a run with re-plans are bitwise those without recompute.

Why bitwise: non-reentrant checkpointing re-runs the same forward ops on the same inputs
(fp32 on CPU, deterministic kernels), the forward draws no random numbers (stochastic rounding
is backward-only, and the backward runs in the same order), and SNIP's probe passes run the
blocks without recompute (model/llama.py). The plan uses NVFP4 so stochastic rounding and the
random Hadamard transform are exercised.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL

from megatron_snip.config import load_config
from megatron_snip.snip.controller import SnipController
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
COMMON = ["model.num_layers=3", "training.max_steps=4", "training.log_interval=1", "training.eval_interval=100",
          "precision.initial_plan=uniform:nvfp4", "snip.enabled=true", "snip.formats=[\"fp8\",\"nvfp4\"]",
          "snip.warmup=1", "snip.interval=2", "snip.probe_batches=1", "snip.noise_draws=1"]


def _run(small_overrides, tmp_path, name: str, *extra: str) -> dict:
    over = [o for o in small_overrides if not o.startswith("training.run_dir")]
    run_dir = tmp_path / name
    cfg = load_config(TINY, over + COMMON + [f"training.run_dir={run_dir}", *extra])
    tr = Trainer(cfg)
    ctl = SnipController(cfg, tr)
    snapshots = []
    real = ctl.replan

    def replan(host, step):
        result = real(host, step)  # a Replan: the host records it after this returns
        snap = dict(result.snapshot)
        snap.pop("timings", None)
        snapshots.append(snap)
        return result

    ctl.replan = replan
    tr.fit([ctl])
    tr.logger.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows if "loss" in r], "plans": [p.hash for p in tr.plan_history],
            "snapshots": snapshots, "params": [p.detach().clone() for p in tr.model.parameters()]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recompute_ref")
    small = SMALL + [f"training.run_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}"]
    return _run(small, tmp, "none")


@pytest.mark.parametrize("extra", [["training.recompute=selective"], ["training.recompute=full"],
                                   ["training.recompute=full", "training.recompute_every=2"]],
                         ids=["selective", "full", "full_every2"])
def test_recompute_is_bitwise_identical_with_snip_replans(reference, small_overrides, tmp_path, extra):
    got = _run(small_overrides, tmp_path, "recompute", *extra)
    assert len(reference["plans"]) == 3 and len(reference["snapshots"]) == 2  # initial + re-plans at steps 1, 3
    assert got["losses"] == reference["losses"]
    assert got["plans"] == reference["plans"]
    assert got["snapshots"] == reference["snapshots"]
    assert all(torch.equal(a, b) for a, b in zip(got["params"], reference["params"]))


def test_recompute_modes_wrap_the_right_blocks(small_overrides):
    tr = Trainer(load_config(TINY, small_overrides + ["model.num_layers=3", "training.recompute=full",
                                                      "training.recompute_every=2"]))
    assert [b.recompute for b in tr.model.layers.values()] == [True, False, True]
    tr.model.set_recompute("selective")
    assert [(b.recompute, b.attn.recompute_core) for b in tr.model.layers.values()] == [(False, True)] * 3
    with pytest.raises(ValueError, match="training.recompute='partial'"):
        load_config(TINY, small_overrides + ["training.recompute=partial"])


def test_keep_intermediates_runs_each_region_once_for_many_backwards():
    """SNIP's propagation pass differentiates one graph once per linear (retain_graph): inside
    ``keep_intermediates`` a ``recompute_cheap`` region runs its forward once, not once per
    backward, and every backward's gradient is the recomputing graph's bit for bit."""
    from megatron_snip.model.recompute import keep_intermediates, recompute_allowed, recompute_cheap

    calls = []

    def region(x):
        calls.append(1)
        return torch.nn.functional.silu(x) * x

    x0 = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = {}
    for keep in (False, True):
        calls.clear()
        x = x0.clone().requires_grad_()
        if keep:
            with keep_intermediates():
                assert not recompute_allowed()
                y = recompute_cheap(region, x)
            assert recompute_allowed()
        else:
            y = recompute_cheap(region, x)
        g = [torch.autograd.grad(y, x, torch.full_like(y, float(k)), retain_graph=True)[0] for k in (1, 2, 3)]
        grads[keep] = g
        assert len(calls) == (1 if keep else 4), (keep, len(calls))  # forward (+ one recompute per backward)
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
