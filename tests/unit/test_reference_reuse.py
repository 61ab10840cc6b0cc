"""A re-plan step reusing the statistics' reference pass (``snip.reuse_step``, issue #24 item 2).

The reference pass runs every linear in BF16 on the probe micro-batches; where those are the
step's own first micro-batches, the step takes their gradients instead of running them again. So:
the statistics snapshot is the same with and without reuse (bit for bit: pass 1 is unchanged);
a step whose micro-batches were all probe batches is exactly a BF16 step (M = 2, a power of two:
dividing the kept sums by M is exact); with fewer probe batches than micro-batches the step is the
reference's gradients plus the others run in the new plan; and where probe and step batches differ,
nothing is reused.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.controller import SnipController, reusable_micro_batches
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
# Two micro-batches of 4 sequences per step; SNIP's probes default to the step's micro-batch size.
SNIP = ["snip.enabled=true", "snip.policy=snip", "snip.warmup=2", "snip.interval=3", "snip.noise_draws=1",
        "training.global_batch_size=8", "training.micro_batch_size=4", "training.max_steps=8"]
STEP = 2


_runs = itertools.count()


def _trainer(small_overrides, *extra):
    """A trainer after two steps, in a run directory of its own."""
    run_dir = next(o for o in small_overrides if o.startswith("training.run_dir=")) + str(next(_runs))
    tr = Trainer(load_config(TINY, small_overrides + SNIP + list(extra) + [run_dir]))
    tr.train_step(0)  # AdamW moments exist: the statistics precondition with them
    tr.train_step(1)
    return tr


def _params(tr):
    return [p.detach().clone() for p in tr.model.parameters()]


def _snapshot_without_timings(replan) -> str:
    return json.dumps({k: v for k, v in replan.snapshot.items() if k != "timings"}, sort_keys=True)


def _bf16(tr) -> PrecisionPlan:
    return PrecisionPlan.create({g: "bf16" for g in tr.all_gemm_ids}, tr.linear_numel)


@pytest.mark.parametrize("probes", [2, 1])
def test_the_snapshot_is_the_same_with_and_without_reuse(small_overrides, probes):
    outcomes = []
    for reuse in ("true", "false"):
        tr = _trainer(small_overrides, f"snip.reuse_step={reuse}", f"snip.probe_batches={probes}")
        outcomes.append(SnipController(tr.cfg, tr).replan(tr, STEP))
        tr.logger.close()
    assert outcomes[0].reused_micro_batches == probes and outcomes[1].reused_micro_batches == 0
    assert _snapshot_without_timings(outcomes[0]) == _snapshot_without_timings(outcomes[1])
    assert outcomes[0].plan.hash == outcomes[1].plan.hash


def test_a_step_all_of_whose_micro_batches_were_probes_is_a_bf16_step(small_overrides):
    """k = M = 2: the re-plan step's update is bit for bit the update a BF16 step makes."""
    reused = _trainer(small_overrides, "snip.reuse_step=true", "snip.probe_batches=2")
    replan = SnipController(reused.cfg, reused).replan(reused, STEP)
    assert replan.reused_micro_batches == 2 and reused.plan.hash != _bf16(reused).hash  # a low-precision plan
    res_reused = reused.train_step(STEP)

    plain = _trainer(small_overrides, "snip.reuse_step=false")
    plain.apply_plan(_bf16(plain))
    res_plain = plain.train_step(STEP)
    assert torch.equal(res_reused.loss_t, res_plain.loss_t)
    assert torch.equal(res_reused.grad_norm_t, res_plain.grad_norm_t)
    for a, b in zip(_params(reused), _params(plain)):
        assert torch.equal(a, b)
    # The reference is used once: the next step runs its own passes in the new plan.
    assert reused._reference is None
    for tr in (reused, plain):
        tr.logger.close()


def test_the_other_micro_batches_run_in_the_new_plan(small_overrides):
    """k = 1 of M = 2: the step's gradient is the reference's for micro-batch 0 plus micro-batch 1's
    in the plan just applied, each over M, accumulated in that order (here rebuilt by hand)."""
    tr = _trainer(small_overrides, "snip.reuse_step=true", "snip.probe_batches=1")
    ctl = SnipController(tr.cfg, tr)
    seen = {}
    real_reduce = tr.grads.reduce

    def capture():
        seen["grads"] = [None if p.grad is None else p.grad.clone() for p in tr.model.parameters()]
        real_reduce()

    replan = ctl.replan(tr, STEP)
    assert replan.reused_micro_batches == 1
    plan = tr.plan
    tr.grads.reduce = capture
    tr.train_step(STEP)

    by_hand = _trainer(small_overrides, "snip.reuse_step=false")
    micro = by_hand.micro_batches(STEP)
    by_hand.optimizer.zero_grad(set_to_none=True)
    by_hand.apply_plan(_bf16(by_hand))
    by_hand.forward_backward(micro[:1], divisor=2)
    by_hand.apply_plan(plan)
    by_hand.forward_backward(micro[1:], divisor=2)
    for got, p in zip(seen["grads"], by_hand.model.parameters()):
        assert (got is None) == (p.grad is None)
        if got is not None:
            assert torch.equal(got, p.grad)
    for t in (tr, by_hand):
        t.logger.close()


def test_nothing_is_reused_where_probes_are_not_the_steps_micro_batches(small_overrides):
    """Probes of 2 sequences are not the step's micro-batches of 4: no reuse, the step as without it."""
    tr = _trainer(small_overrides, "snip.reuse_step=true", "snip.probe_micro_batch_size=2")
    assert SnipController(tr.cfg, tr).replan(tr, STEP).reused_micro_batches == 0
    assert tr._reference is None
    tr.logger.close()


def test_a_reference_for_another_step_is_dropped(small_overrides):
    """A re-plan whose step never trains (e.g. a benchmark re-planning alone) leaves nothing behind
    for a later step: that step runs all its micro-batches."""
    tr = _trainer(small_overrides, "snip.reuse_step=true", "snip.probe_batches=2")
    SnipController(tr.cfg, tr).replan(tr, 5)
    other = _trainer(small_overrides, "snip.reuse_step=false")
    other.apply_plan(tr.plan)
    res, res_other = tr.train_step(STEP), other.train_step(STEP)
    assert torch.equal(res.loss_t, res_other.loss_t)
    for t in (tr, other):
        t.logger.close()


def test_reusable_micro_batches_is_the_common_prefix():
    a, b, c = (torch.full((2, 5), v) for v in (1, 2, 3))
    assert reusable_micro_batches([a, b], [a, b, c]) == 2
    assert reusable_micro_batches([a, c], [a, b]) == 1
    assert reusable_micro_batches([b], [a, b]) == 0
    assert reusable_micro_batches([a[:1]], [a]) == 0  # another shape


def test_the_metrics_line_says_what_was_reused(small_overrides, tmp_path):
    cfg = load_config(TINY, small_overrides + SNIP + ["snip.reuse_step=true", "snip.probe_batches=2",
                                                      "training.max_steps=3", "training.log_interval=1"])
    tr = Trainer(cfg)
    tr.fit([SnipController(cfg, tr)])
    tr.logger.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    replans = [r for r in lines if "replan_fp4_share" in r]
    assert [r["step"] for r in replans] == [STEP] and replans[0]["replan_reused_micro_batches"] == 2
