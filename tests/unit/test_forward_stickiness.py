"""Kept forward formats (``snip.forward_stickiness``, ``snip/cost_memory.py`` kept_forward): the discount
itself, the config's refusal of a bad value, the controller's use of it on a small model (against the
solve of its own recorded snapshot with the plan in force discounted), the offline planner's replay
of it, and a resume that keeps it exactly."""

from __future__ import annotations

import json
import math

import pytest

from megatron_snip.config import load_config
from megatron_snip.precision.plan import GemmId, PrecisionPlan
from megatron_snip.snip import cost_memory
from megatron_snip.snip.metrics import predicted_divergence
from megatron_snip.snip.policies import policy_costs
from tests.unit.snip_runs import fit_snip, preempted_and_resumed, solve_plan_script, step_losses

TINY = "launch/configs/tiny.toml"
# re-plans at steps 2 and 5 of 8
SNIP = ["snip.enabled=true", "snip.policy=snip", "snip.warmup=2", "snip.interval=3", "snip.probe_batches=1",
        "snip.noise_draws=1", "training.log_interval=1", "training.eval_interval=100", "training.max_steps=8"]
KEPT = SNIP + ["snip.forward_stickiness=1.0"]
F, D, W = GemmId(0, "qkv", "fprop"), GemmId(0, "qkv", "dgrad"), GemmId(1, "fc2", "wgrad")


def test_only_the_forward_gemms_format_in_force_is_discounted():
    costs = {F: {"fp8": 0.2, "nvfp4": 1.0}, D: {"fp8": 0.1, "nvfp4": 0.5}, W: {"fp8": 0.0, "nvfp4": 0.25}}
    in_force = {F: "nvfp4", D: "nvfp4", W: "fp8"}
    got = cost_memory.kept_forward(costs, in_force, 0.75)
    assert got == {F: {"fp8": 0.2, "nvfp4": 0.25 * 1.0}, D: costs[D], W: costs[W]}  # backward GEMMs untouched
    assert costs[F]["nvfp4"] == 1.0 and got[F] is not costs[F]  # a copy: the caller's table is never changed
    assert cost_memory.kept_forward(costs, in_force, 0.0) == costs
    assert cost_memory.kept_forward(costs, in_force, 1.0)[F] == {"fp8": 0.2, "nvfp4": 0.0}  # staying is free
    # a format in force that is not priced (BF16 before the first plan), and a format not allowed, get nothing
    assert cost_memory.kept_forward(costs, {F: "bf16"}, 1.0) == costs
    barred = {F: {"fp8": 0.2, "nvfp4": math.inf}}
    assert cost_memory.kept_forward(barred, {F: "nvfp4"}, 1.0) == barred
    with pytest.raises(ValueError, match=r"forward_stickiness=1.5 must be in \[0, 1\]"):
        cost_memory.kept_forward(costs, in_force, 1.5)


@pytest.mark.parametrize("bad", ["1.5", "-0.1"])
def test_a_stickiness_outside_0_1_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=rf"snip.forward_stickiness.*{bad}.*must be in \[0, 1\]"):
        load_config(TINY, [f"snip.forward_stickiness={bad}"])


def test_the_controller_solves_with_the_plan_in_force_discounted(small_overrides, tmp_path):
    """With forward_stickiness = 1 the step-5 plan keeps step 2's forward formats where the measured costs
    alone would move them: it is the offline planner's solve of the step-5 snapshot with step 2's plan
    discounted (``--run-dir``), not the solve of the snapshot alone. Its recorded predicted divergence is
    priced with the measured costs, and it records the stickiness."""
    tr, _ = fit_snip(small_overrides + KEPT)
    run = tmp_path / "run"
    assert [p.step for p in tr.plan_history] == [0, 2, 5]
    plan2, plan5 = PrecisionPlan.load(run / "plans/step_000002.json"), PrecisionPlan.load(run / "plans/step_000005.json")
    assert dict(plan5.extra)["forward_stickiness"] == 1.0
    fp4 = str(tr.cfg.snip.fp4_target)
    stats = str(run / "plans/step_000005_stats.json")
    mod = solve_plan_script()
    assert mod.main(["--stats", stats, "--run-dir", str(run), "--fp4-target", fp4, "--out", str(tmp_path / "kept")]) == 0
    assert PrecisionPlan.load(tmp_path / "kept/plan.json").as_dict() == plan5.as_dict()
    assert mod.main(["--stats", stats, "--fp4-target", fp4, "--out", str(tmp_path / "plain")]) == 0
    plain = PrecisionPlan.load(tmp_path / "plain/plan.json").as_dict()
    fprops = [g for g in plan5.as_dict() if g.gemm == "fprop"]
    moved_plain = sum(plain[g] != plan2.as_dict()[g] for g in fprops)
    moved_kept = sum(plan5.as_dict()[g] != plan2.as_dict()[g] for g in fprops)
    assert moved_kept < moved_plain  # the discount is what kept them
    c5 = policy_costs("snip", json.loads((run / "plans/step_000005_stats.json").read_text()))
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "predicted_divergence" in r}
    assert rows[5]["predicted_divergence"] == predicted_divergence(c5, plan5.as_dict())


def test_without_stickiness_no_plan_records_it(small_overrides, tmp_path):
    tr, _ = fit_snip(small_overrides + SNIP)
    assert all("forward_stickiness" not in dict(p.extra) for p in tr.plan_history)


def test_a_resumed_run_keeps_the_forward_formats_exactly(small_overrides, tmp_path):
    """Preempted after step 4 (checkpoint at 4, between the re-plans of steps 2 and 5) and resumed: the
    step-5 plan discounts the restored step-2 plan's forward formats, so the plans and the losses are
    those of the uninterrupted run, bit for bit."""
    full, _ = fit_snip(small_overrides + KEPT)
    run2 = tmp_path / "run2"
    resumed, _ = preempted_and_resumed(small_overrides + KEPT, run2, crash_after=4)
    assert [p.hash for p in resumed.plan_history] == [p.hash for p in full.plan_history]
    assert step_losses(run2) == step_losses(tmp_path / "run")
    assert math.isfinite(sum(step_losses(run2).values()))
