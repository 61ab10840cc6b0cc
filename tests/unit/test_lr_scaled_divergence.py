"""``snip.weight_divergence_lr_scaled``: lambda times the plan's mean LR over its interval / peak.

The expected scales are written from the WSD formula (peak until the onset, then linear to
``min_lr`` over the last ``wsd_decay_fraction`` of the steps), not from ``lr_at``."""

from __future__ import annotations

import math

import pytest

from megatron_snip.config import load_config
from megatron_snip.snip.budget import plan_lr_scale
from megatron_snip.snip.policies import policy_costs

TINY = "launch/configs/tiny.toml"
# 300 steps, WSD onset at 240, re-plans at 20, 120, 220 (and the onset under the run budget)
WSD = ["training.max_steps=300", "training.warmup_steps=0", "training.lr_schedule=wsd", "training.lr=1e-3",
       "training.min_lr=1e-4", "snip.enabled=true", "snip.warmup=20", "snip.interval=100"]


def _decay_mean(m: float) -> float:
    """Mean of lr / peak over the 60 decay steps 240..299: 1 - (1 - m) * mean(k / 60, k = 0..59)."""
    return 1 - (1 - m) * (59 / 120)


@pytest.mark.parametrize("budget", ["plan", "run"])
def test_the_scale_is_the_mean_lr_over_the_plans_interval(budget):
    cfg = load_config(TINY, WSD + [f"snip.budget={budget}"])
    m = 0.1
    assert plan_lr_scale(cfg, 20) == 1.0 and plan_lr_scale(cfg, 120) == 1.0  # the stable phase
    if budget == "plan":  # the plan of step 220 runs to the end: 20 steps at the peak, 60 decaying
        assert math.isclose(plan_lr_scale(cfg, 220), (20 + 60 * _decay_mean(m)) / 80, rel_tol=1e-12)
    else:  # the onset is a re-plan: 220's plan stops there, the onset's runs the decay
        assert plan_lr_scale(cfg, 220) == 1.0
        assert math.isclose(plan_lr_scale(cfg, 240), _decay_mean(m), rel_tol=1e-12)


def test_constant_lr_and_lr_warmup():
    cfg = load_config(TINY, WSD + ["training.lr_schedule=constant"])
    assert plan_lr_scale(cfg, 220) == 1.0
    # linear LR warmup over 40 steps: lr_k / peak = (k + 1) / 40, the plan of step 20 runs 20..119
    cfg = load_config(TINY, WSD + ["training.lr_schedule=constant", "training.warmup_steps=40"])
    expected = (sum((k + 1) / 40 for k in range(20, 40)) + 80) / 100
    assert math.isclose(plan_lr_scale(cfg, 20), expected, rel_tol=1e-12)


RUN = ["snip.enabled=true", "snip.warmup=2", "snip.interval=4", "snip.probe_batches=1", "snip.noise_draws=1",
       "snip.fair_share=true", "snip.fp4_target=0.75", "training.lr_schedule=wsd", "training.max_steps=20",
       "training.log_interval=1", "training.eval_interval=100"]


def _replans(overrides):
    """The re-plans of a 20-step SNIP run on the small model (plan budget, WSD onset at 16)."""
    from megatron_snip.snip.controller import SnipController
    from megatron_snip.training.trainer import Trainer

    cfg = load_config(TINY, overrides)
    tr = Trainer(cfg)
    ctl = SnipController(cfg, tr)
    seen = []
    record = tr.record_replan
    tr.record_replan = lambda replan: (seen.append(replan), record(replan))
    tr.fit([ctl])
    ctl.on_train_end(tr)
    tr.logger.close()
    return cfg, seen


def test_a_run_prices_each_plan_at_its_intervals_lr(small_overrides):
    """The costs each re-plan solves on are SNIP's at lambda x the interval's LR scale, the plan
    records that lambda, and the plan of step 14 (steps 14..17: two of them in the decay) weighs
    dW less than at the peak."""
    cfg, replans = _replans(small_overrides + RUN + ["snip.weight_divergence_lr_scaled=true",
                                                     "snip.weight_divergence_weight=2.0"])
    assert [r.step for r in replans] == [2, 6, 10, 14, 18]
    for r in replans:
        lam = 2.0 * plan_lr_scale(cfg, r.step)
        assert dict(r.plan.extra)["weight_divergence_weight"] == lam
        assert r.costs == policy_costs("snip", r.snapshot, lam)
    late = replans[3]
    assert plan_lr_scale(cfg, 14) < 1.0 and late.costs != policy_costs("snip", late.snapshot, 2.0)
