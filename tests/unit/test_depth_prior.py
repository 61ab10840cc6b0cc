"""The depth prior on the forward GEMMs' costs (``snip.forward_depth_prior``, ``snip/priors.py``): the
factors, the weighting, the config's refusal of a bad value, and the controller's use of it on a small
model against the offline planner's replay (and against the solve without it)."""

from __future__ import annotations

import math

import pytest

from megatron_snip.config import load_config
from megatron_snip.precision.plan import GemmId, PrecisionPlan
from megatron_snip.snip import priors
from tests.unit.snip_runs import fit_snip, solve_plan_script

TINY = "launch/configs/tiny.toml"
SNIP = ["snip.enabled=true", "snip.policy=snip", "snip.warmup=2", "snip.interval=3", "snip.probe_batches=1",
        "snip.noise_draws=1", "training.log_interval=1", "training.eval_interval=100", "training.max_steps=8"]


def test_the_factors_ramp_with_depth_and_average_one():
    m = priors.depth_factors(4, 1.0)
    assert m == pytest.approx([0.25, 0.75, 1.25, 1.75], rel=1e-15)  # (l + 1/2) / 4, over its mean 1/2
    m2 = priors.depth_factors(8, 2.0)
    assert sum(m2) / 8 == pytest.approx(1.0, rel=1e-15) and m2 == sorted(m2) and m2[0] < m[0]
    assert priors.depth_factors(5, 0.0) == [1.0] * 5
    with pytest.raises(ValueError, match=r"forward_depth_prior=-1 must be >= 0"):
        priors.depth_factors(4, -1)


def test_only_the_forward_gemms_are_weighted():
    f0, f3, d3 = GemmId(0, "fc2", "fprop"), GemmId(3, "qkv", "fprop"), GemmId(3, "qkv", "dgrad")
    costs = {f0: {"fp8": 0.2, "nvfp4": 1.0}, f3: {"fp8": 0.1, "nvfp4": math.inf}, d3: {"fp8": 0.3, "nvfp4": 0.5}}
    got = priors.depth_weighted(costs, 4, 1.0)
    assert got == {f0: {"fp8": 0.2 * 0.25, "nvfp4": 0.25}, f3: {"fp8": 0.1 * 1.75, "nvfp4": math.inf}, d3: costs[d3]}
    assert got[d3] is not costs[d3] and costs[f0]["nvfp4"] == 1.0  # a copy
    with pytest.raises(ValueError, match=r"GEMM 3.qkv.fprop is outside the model's 2 blocks"):
        priors.depth_weighted(costs, 2, 1.0)


@pytest.mark.parametrize("bad", ["-0.5", "nan"])
def test_a_negative_power_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"snip.forward_depth_prior"):
        load_config(TINY, [f"snip.forward_depth_prior={bad}"])


def test_the_controller_solves_the_weighted_costs(small_overrides, tmp_path):
    """The step-5 plan under forward_depth_prior = 4 is the offline planner's solve of the step-5 snapshot
    with the run's prior (``--run-dir``), not the solve without it, and it records the prior."""
    tr, _ = fit_snip(small_overrides + SNIP + ["snip.forward_depth_prior=4"])
    run = tmp_path / "run"
    plan5 = PrecisionPlan.load(run / "plans/step_000005.json")
    assert dict(plan5.extra)["forward_depth_prior"] == 4.0
    mod = solve_plan_script()
    fp4, stats = str(tr.cfg.snip.fp4_target), str(run / "plans/step_000005_stats.json")
    assert mod.main(["--stats", stats, "--run-dir", str(run), "--fp4-target", fp4, "--out", str(tmp_path / "p")]) == 0
    assert PrecisionPlan.load(tmp_path / "p/plan.json").as_dict() == plan5.as_dict()
    assert mod.main(["--stats", stats, "--fp4-target", fp4, "--out", str(tmp_path / "plain")]) == 0
    assert PrecisionPlan.load(tmp_path / "plain/plan.json").as_dict() != plan5.as_dict()


def test_the_solver_costs_apply_the_configured_terms():
    """``solver_costs``, which the controller and the offline planner share: nothing when both terms are
    off (the same table), the discount and the depth weights when on."""
    f0, d1 = GemmId(0, "fc2", "fprop"), GemmId(1, "qkv", "dgrad")
    costs = {f0: {"fp8": 0.2, "nvfp4": 1.0}, d1: {"fp8": 0.3, "nvfp4": 0.5}}
    cfg = load_config(TINY).snip
    assert priors.solver_costs(costs, cfg, 2, {}) is costs
    on = load_config(TINY, ["snip.forward_stickiness=0.5", "snip.forward_depth_prior=1"]).snip
    # depth factors for 2 blocks at p = 1: 0.5, 1.5; block 0's fprop in nvfp4 also halved by the stickiness
    assert priors.solver_costs(costs, on, 2, {f0: "nvfp4"}) == {f0: {"fp8": 0.2 * 0.5, "nvfp4": 0.5 * 0.5}, d1: costs[d1]}
