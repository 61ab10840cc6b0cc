"""The SNIP controller on a small model: it re-plans on schedule, applies and records each plan
(JSON, statistics snapshot, PNG), and a resumed run continues with the same plans and losses.
Also the offline planner on a snapshot the controller wrote."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.adam_moments import adam_denominator
from megatron_snip.snip.controller import SnipController, is_replan_step, probe_gradient_warning
from megatron_snip.snip.host import SnipHost
from megatron_snip.training.trainer import Trainer
from tests.unit.snip_runs import fit_snip, preempted_and_resumed, solve_plan_script, step_losses

TINY = "launch/configs/tiny.toml"
SNIP = ["snip.enabled=true", "snip.policy=snip", "snip.warmup=2", "snip.interval=3", "snip.probe_batches=1",
        "snip.noise_draws=1", "training.log_interval=1", "training.eval_interval=100", "training.max_steps=8"]


def _fit(overrides, crash_after=None):
    return fit_snip(overrides, crash_after)[0]


def test_schedule():
    assert [s for s in range(40) if is_replan_step(s, 10, 20)] == [10, 30]


def test_the_trainer_is_a_snip_host(small_overrides):
    """Every member SNIP uses of its host (snip/host.py) exists on the Trainer."""
    tr = Trainer(load_config(TINY, small_overrides + SNIP))
    assert isinstance(tr, SnipHost)
    assert not isinstance(object(), SnipHost)
    tr.logger.close()


def test_a_replan_is_a_value_the_host_records(small_overrides, tmp_path):
    """``replan`` applies the plan and returns it with its snapshot and timings, writing nothing;
    ``record_replan`` then writes the plan JSON, snapshot and PNG and the metrics line."""
    cfg = load_config(TINY, small_overrides + SNIP)
    tr = Trainer(cfg)
    tr.train_step(0)
    before = tr.plan
    outcome = SnipController(cfg, tr).replan(tr, 2)
    plans = tmp_path / "run" / "plans"
    assert outcome.applied and outcome.plan is tr.plan and outcome.plan.step == 2
    assert outcome.gemms_changed == sum(a != b for (_, a), (_, b) in zip(before.entries, tr.plan.entries)) > 0
    assert outcome.snapshot["step"] == 2 and outcome.timings["replan_total_s"] > 0 and outcome.count == 1
    assert sorted(p.name for p in plans.iterdir()) == ["step_000000.json"] and "snip" not in tr.extra_state
    tr.record_replan(outcome)
    assert sorted(p.name for p in plans.iterdir()) == ["step_000000.json", "step_000002.json", "step_000002.png",
                                                       "step_000002_stats.json"]
    assert PrecisionPlan.load(plans / "step_000002.json").hash == outcome.plan.hash
    assert tr.extra_state["snip"]["replans"] == 1 and [p.step for p in tr.plan_history] == [0, 2]
    tr.logger.close()
    replan_rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
                   if "replan_fp4_share" in r]
    assert [r["step"] for r in replan_rows] == [2] and "predicted_divergence" in replan_rows[0]
    # the probe gradient and update norms behind the plan, for dashboards (a spike: probe_gradient_warning)
    assert replan_rows[0]["replan_probe_grad_norm"] == math.sqrt(outcome.snapshot["probe_sq_grad"]) > 0
    assert replan_rows[0]["replan_update_norm"] == math.sqrt(outcome.snapshot["total_sq_update"]) > 0
    # the re-plan's time in its parts (issue #24): statistics, metrics, solve, broadcast, apply
    assert {"replan_stats_s", "replan_metrics_s", "replan_solve_s", "replan_broadcast_s", "replan_apply_s",
            "replan_replan_total_s"} <= replan_rows[0].keys()


def test_a_failed_solve_keeps_the_plan_and_records_only_why(small_overrides, tmp_path, monkeypatch):
    from megatron_snip.snip import controller, ilp

    def infeasible(*args, **kwargs):
        raise ilp.InfeasibleError("no way")

    cfg = load_config(TINY, small_overrides + SNIP + ["snip.policy=random"])
    tr = Trainer(cfg)
    before = tr.plan
    monkeypatch.setattr(controller, "make_plan", infeasible)
    outcome = SnipController(cfg, tr).replan(tr, 2)
    assert not outcome.applied and outcome.plan is before and tr.plan is before
    assert outcome.kept == f"solve failed (no way); keeping the previous plan {before.hash}"
    tr.record_replan(outcome)
    tr.logger.close()
    assert sorted(p.name for p in (tmp_path / "run" / "plans").iterdir()) == ["step_000000.json"]
    assert tr.plan_history == [before] and "snip" not in tr.extra_state


def test_the_snapshot_has_the_probe_gradients_norm_and_a_clipped_one_warns(small_overrides, capsys):
    """``probe_sq_grad`` is the squared norm of the probe batches' mean gradient over every parameter
    (the tensor training clips); a re-plan whose probe gradient training would clip to less than
    half says so."""
    cfg = load_config(TINY, small_overrides + SNIP + ["snip.probe_batches=2", "training.grad_clip=1e-6"])
    tr = Trainer(cfg)
    ctl = SnipController(cfg, tr)
    probes = [tr.load_batch(b) for b in ctl.probe_batches(tr, 2)]
    tr.optimizer.zero_grad(set_to_none=True)
    for b in probes:  # the reference pass's own calls, with the initial plan's BF16 GEMMs
        tr.forward_backward([b])
    want = sum((p.grad / len(probes)).pow(2).sum().item() for p in tr.model.parameters() if p.grad is not None)
    tr.optimizer.zero_grad(set_to_none=True)
    outcome = ctl.replan(tr, 2)
    # the same GEMMs on the same tokens (bit-equal here); only the sum over the 15 parameter tensors
    # may run in another order: in fp32 at most 15 x 6e-8 = 9e-7 relative, so 1e-5
    assert outcome.snapshot["probe_sq_grad"] == pytest.approx(want, rel=1e-5)
    assert "over twice training.grad_clip=1e-06" in capsys.readouterr().out
    tr.logger.close()


@pytest.mark.parametrize("mode", ["stored", "with_probe"])
def test_the_controller_preconditions_by_the_configured_second_moment(small_overrides, mode):
    """snip.preconditioner reaches the statistics: after two training steps the snapshot's update norm
    is the probe gradient over ``adam_denominator`` of that mode (the v̂ AdamW holds, or the one its next
    update divides by), not over the other mode's."""
    cfg = load_config(TINY, small_overrides + SNIP + [f"snip.preconditioner={mode}"])
    tr = Trainer(cfg)
    ctl = SnipController(cfg, tr)
    for _ in range(2):
        tr.train_step(tr.step)
        tr.step += 1
    (probe,) = [tr.load_batch(b) for b in ctl.probe_batches(tr, 2)]
    tr.optimizer.zero_grad(set_to_none=True)
    tr.forward_backward([probe])
    params = [p for p in tr.model.parameters() if p.grad is not None]
    want = {m: sum((p.grad / adam_denominator(tr.optimizer, p, p.grad, with_grad=m == "with_probe")).pow(2).sum().item()
                   for p in params) for m in ("stored", "with_probe")}
    tr.optimizer.zero_grad(set_to_none=True)
    got = ctl.replan(tr, 2).snapshot["total_sq_update"]
    # bit-equal GEMMs and per-tensor sums (as above); only the sum over the tensors may run in another
    # order: 15 fp32 additions, at most 9e-7 relative, so 1e-5
    assert got == pytest.approx(want[mode], rel=1e-5)
    other = want["stored" if mode == "with_probe" else "with_probe"]
    assert abs(got - other) > 1e-3 * other
    tr.logger.close()


def test_probe_gradient_warning_only_past_the_clip():
    snap = {"probe_sq_grad": 4.0, "num_probe_batches": 2}
    assert "norm 2, over twice training.grad_clip=0.9" in probe_gradient_warning(snap, 0.9)
    assert probe_gradient_warning(snap, 1.0) is None  # cut to exactly half: a rescale, not a spike
    assert probe_gradient_warning(snap, 2.5) is None
    assert probe_gradient_warning(snap, 0.0) is None  # no clipping: nothing to compare with
    assert probe_gradient_warning({"num_probe_batches": 2}, 1.0) is None  # truth / older snapshots


def test_probe_micro_batches_follow_the_config(small_overrides):
    """snip.probe_micro_batch_size sets the probe's micro-batches (0: the training micro-batch); they
    are consecutive sequences from the step's data, this DP rank's share after the ranks before it."""
    cfg = load_config(TINY, small_overrides + SNIP + ["snip.probe_batches=2", "snip.probe_micro_batch_size=3"])
    tr = Trainer(cfg)
    t, step = cfg.training, 4
    probe = SnipController(cfg, tr).probe_batches(tr, step)
    assert [tuple(b.shape) for b in probe] == [(3, t.seq_len + 1)] * 2
    assert torch.equal(torch.cat(probe), tr.data.train.batch(step * t.global_batch_size, 6))
    tr.topo = dataclasses.replace(tr.topo, dp_rank=1)
    assert torch.equal(SnipController(cfg, tr).probe_batches(tr, step)[0],
                       tr.data.train.batch(step * t.global_batch_size + 6, 3))

    default = load_config(TINY, small_overrides + SNIP)
    assert [tuple(b.shape) for b in SnipController(default, tr).probe_batches(tr, step)] == \
        [(t.micro_batch_size, t.seq_len + 1)]
    tr.logger.close()


def test_controller_plans_records_and_resumes(small_overrides, tmp_path):
    full = _fit(small_overrides + SNIP)
    run = tmp_path / "run"
    assert [p.step for p in full.plan_history] == [0, 2, 5]
    for step in (2, 5):
        plan = PrecisionPlan.load(run / "plans" / f"step_{step:06d}.json")
        assert plan.policy == "snip" and plan.solver_status == "OPTIMAL" and plan.fp4_flops_share >= 0.75
        assert (run / "plans" / f"step_{step:06d}.png").stat().st_size > 0
        stats = json.loads((run / "plans" / f"step_{step:06d}_stats.json").read_text())
        assert stats["step"] == step and len(stats["linears"]) == 2 * 4
    assert full.model.layers["0"].mlp.fc1.precision == full.plan.for_linear(0, "fc1")
    assert (run / "precision_map.png").is_file() and (run / "timeline.png").is_file()

    run2 = tmp_path / "run2"
    resumed, _ = preempted_and_resumed(small_overrides + SNIP, run2, crash_after=4)
    assert [p.hash for p in resumed.plan_history] == [p.hash for p in full.plan_history]
    assert step_losses(run2) == step_losses(run), "resumed SNIP run diverged from the uninterrupted one"


def test_offline_planner_reproduces_the_controllers_plan(small_overrides, tmp_path):
    _fit(small_overrides + SNIP[:-1] + ["training.max_steps=3"])
    mod = solve_plan_script()
    out = tmp_path / "offline"
    assert mod.main(["--stats", str(tmp_path / "run/plans/step_000002_stats.json"), "--fp4-target", "0.75",
                     "--out", str(out)]) == 0
    offline = PrecisionPlan.load(out / "plan.json")
    online = PrecisionPlan.load(tmp_path / "run/plans/step_000002.json")
    assert offline.as_dict() == online.as_dict()
    assert (out / "plan.png").stat().st_size > 0 and (out / "pareto.png").stat().st_size > 0
    pareto = json.loads((out / "pareto.json").read_text())
    objectives = [p["objective"] for p in pareto]
    assert objectives == sorted(objectives)  # a higher FP4 target never predicts less divergence
    assert mod.main(["--stats", str(tmp_path / "missing.json"), "--out", str(out)]) == 2


def test_an_unknown_preconditioner_is_refused_by_name():
    with pytest.raises(ValueError, match=r"snip.preconditioner.*'next'.*choose one of \['stored', 'with_probe'\]"):
        load_config(TINY, ["snip.preconditioner=next"])
