"""Costs remembered across re-plans (``snip.cost_ema``, ``snip/cost_memory.py``): the average itself,
its checkpointed form, the controller's use of it on a small model (against the average of the
costs of its own recorded snapshots), the offline planner's replay of it, and a resume that keeps it
exactly."""

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
EMA = SNIP + ["snip.cost_ema=0.5"]
A, B = GemmId(0, "qkv", "fprop"), GemmId(1, "fc2", "wgrad")


def test_the_average_weighs_the_memory_by_beta():
    now = {A: {"fp8": 0.2, "nvfp4": 1.0}, B: {"fp8": 0.0, "nvfp4": 0.5}}
    memory = {A: {"fp8": 0.4, "nvfp4": 3.0}, B: {"fp8": 0.1, "nvfp4": 0.25}}
    got = cost_memory.smoothed(now, memory, 0.75)
    assert got == {A: {"fp8": 0.75 * 0.4 + 0.25 * 0.2, "nvfp4": 0.75 * 3.0 + 0.25 * 1.0},
                   B: {"fp8": 0.75 * 0.1 + 0.25 * 0.0, "nvfp4": 0.75 * 0.25 + 0.25 * 0.5}}
    # no memory, no weight, or a memory of other units (a changed candidate set): this re-plan's own costs
    assert cost_memory.smoothed(now, None, 0.75) == now
    assert cost_memory.smoothed(now, memory, 0.0) == now
    other = {A: {"fp8": 0.4, "bf16": 0.0}, B: memory[B]}
    assert not cost_memory.same_units(now, other) and cost_memory.smoothed(now, other, 0.75) == now
    assert cost_memory.smoothed(now, None, 0.5) is not now  # a copy: the caller's table is never aliased
    with pytest.raises(ValueError, match=r"cost_ema=1.0 must be in \[0, 1\)"):
        cost_memory.smoothed(now, memory, 1.0)


def test_the_checkpointed_form_reads_back_to_the_same_floats():
    costs = {A: {"fp8": 0.1 + 0.2, "nvfp4": 1 / 3}, B: {"fp8": 5e-324, "nvfp4": 1e300}}
    state = cost_memory.to_state(costs)
    assert state == {"0.qkv.fprop": {"fp8": 0.1 + 0.2, "nvfp4": 1 / 3}, "1.fc2.wgrad": {"fp8": 5e-324, "nvfp4": 1e300}}
    assert cost_memory.from_state(json.loads(json.dumps(state))) == costs
    assert cost_memory.from_state(None) is None
    with pytest.raises(ValueError, match=r"entry '0.qkv.fprop' is 'x', not \{format: cost\}"):
        cost_memory.from_state({"0.qkv.fprop": "x"})
    with pytest.raises(TypeError, match=r"list, not a mapping of GEMM keys"):
        cost_memory.from_state([1, 2])
    with pytest.raises(ValueError, match=r"plan entry key 'qkv'"):
        cost_memory.from_state({"qkv": {"fp8": 1.0}})


@pytest.mark.parametrize("bad", ["1.0", "-0.1", "1.5"])
def test_a_weight_outside_0_1_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=rf"snip.cost_ema.*{bad}.*must be in \[0, 1\)"):
        load_config(TINY, [f"snip.cost_ema={bad}"])


def _snapshot_costs(run, step):
    return policy_costs("snip", json.loads((run / "plans" / f"step_{step:06d}_stats.json").read_text()))


def test_the_controller_plans_from_the_average_of_its_recorded_costs(small_overrides, tmp_path):
    """With cost_ema = 0.5 the step-5 plan is solved from 0.5 x (step 2's costs) + 0.5 x (step 5's), each
    recomputed from the snapshot the run wrote: the checkpointed memory is that average, the plan's
    recorded predicted divergence is priced with it, and the plan records its weight."""
    tr, ctl = fit_snip(small_overrides + EMA)
    run = tmp_path / "run"
    assert [p.step for p in tr.plan_history] == [0, 2, 5]
    c2, c5 = _snapshot_costs(run, 2), _snapshot_costs(run, 5)
    expected = {g: {f: 0.5 * c2[g][f] + 0.5 * c for f, c in per_f.items()} for g, per_f in c5.items()}
    assert ctl.cost_memory == expected and cost_memory.from_state(tr.extra_state["snip"]["cost_memory"]) == expected
    assert any(c2[g][f] != c5[g][f] for g in c5 for f in c5[g])  # so the average is not either re-plan's costs
    plan5 = PrecisionPlan.load(run / "plans" / "step_000005.json")
    assert dict(plan5.extra)["cost_ema"] == 0.5
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "predicted_divergence" in r}
    assert rows[5]["predicted_divergence"] == predicted_divergence(expected, plan5.as_dict())
    assert rows[2]["predicted_divergence"] == predicted_divergence(c2, tr.plan_history[1].as_dict())  # the first: its own

    # offline, scripts/solve_plan.py --run-dir replays the memory from the earlier snapshots: the run's plan
    mod = solve_plan_script()
    out = tmp_path / "offline"
    fp4 = str(tr.cfg.snip.fp4_target)
    assert mod.main(["--stats", str(run / "plans/step_000005_stats.json"), "--run-dir", str(run), "--fp4-target", fp4,
                     "--out", str(out)]) == 0
    assert PrecisionPlan.load(out / "plan.json").as_dict() == plan5.as_dict()


def test_without_a_weight_nothing_is_remembered(small_overrides, tmp_path):
    """The default (cost_ema = 0): no memory in the checkpointed state or the plans, and the offline
    planner's --run-dir says that the run has nothing that changes a plan."""
    tr, ctl = fit_snip(small_overrides + SNIP)
    run = tmp_path / "run"
    assert ctl.cost_memory is None and "cost_memory" not in tr.extra_state["snip"]
    assert all("cost_ema" not in dict(p.extra) for p in tr.plan_history)
    mod = solve_plan_script()
    assert mod.main(["--stats", str(run / "plans/step_000005_stats.json"), "--run-dir", str(run),
                     "--out", str(tmp_path / "o")]) == 2


def test_a_resumed_run_keeps_the_memory_exactly(small_overrides, tmp_path):
    """Preempted after step 4 (checkpoint at 4, between the re-plans of steps 2 and 5) and resumed: the
    step-5 plan averages with the restored step-2 costs, so the plans, the losses and the final memory
    are those of the uninterrupted run, bit for bit."""
    full, full_ctl = fit_snip(small_overrides + EMA)
    run2 = tmp_path / "run2"
    resumed, resumed_ctl = preempted_and_resumed(small_overrides + EMA, run2, crash_after=4)
    assert [p.hash for p in resumed.plan_history] == [p.hash for p in full.plan_history]
    assert resumed_ctl.cost_memory == full_ctl.cost_memory
    assert step_losses(run2) == step_losses(tmp_path / "run")
    assert math.isfinite(sum(step_losses(run2).values()))
