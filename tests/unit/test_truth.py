"""Measured divergences (snip/truth.py) and the ``truth`` policy that plans with them.

On the quadratic stand-in of test_snip_metrics (L = c/2·‖Y − X·Aᵀ‖², Hessian c·I in Y) the
measured loss change has closed-form parts: the mirrored pair's even part is ½·c·‖e_Y‖², its odd
part <G, e_Y>. Update changes are checked against a hand-computed AdamW direction, and against
structure (a first linear's dgrad reaches no parameter: exactly 0).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.plan import GemmId, GemmPrecision
from megatron_snip.precision.quantize import quantize
from megatron_snip.snip import truth
from megatron_snip.snip.controller import SnipController
from megatron_snip.snip.metrics import truth_costs
from megatron_snip.snip.policies import PlanContext, make_plan, parse_policy, policy_costs
from megatron_snip.training.trainer import Trainer
from tests.unit.test_snip_metrics import C, K, QuadraticTrainer, T


def _fprop_error(lin, x, fmt):
    with torch.no_grad():
        return lin.local_gemm(x, GemmPrecision(fprop=fmt)) - lin.local_gemm(x, GemmPrecision())


def test_mirrored_loss_changes_split_into_the_closed_form_taylor_terms():
    """Quadratic loss, one linear: (ΔL + ΔL_mirror)/2 = ½·c·‖e_Y‖² and (ΔL − ΔL_mirror)/2 = <G, e_Y>
    exactly; fp32 sums of T·N = 4096 terms of one sign, so rel 1e-4 covers their rounding."""
    tr = QuadraticTrainer()
    x = torch.randn(T, K)
    lin = tr.model.lins[0]
    plus = truth.loss_changes(tr, ("nvfp4",), [x])["0.fc2", "nvfp4"][0]
    minus = truth.loss_changes(tr, ("nvfp4",), [x], mirrored=True)["0.fc2", "nvfp4"][0]
    e = _fprop_error(lin, x, "nvfp4")
    with torch.no_grad():
        g = C * (lin.local_gemm(x, GemmPrecision()) - x @ tr.target_map.t())  # dL/dY
    assert (plus + minus) / 2 == pytest.approx(0.5 * C * float(e.pow(2).sum()), rel=1e-4)
    assert (plus - minus) / 2 == pytest.approx(float((g * e).sum()), rel=1e-4, abs=1e-4 * float(g.abs().sum() * e.abs().max()))


def test_changes_are_measured_against_all_bf16_and_the_plan_in_force_comes_back():
    """With every GEMM in NVFP4 before the measurement, the reference is still all-BF16 (a bf16
    "format" changes nothing, exactly) and every linear gets its precision back."""
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(v_hat=0.04)
    plan = GemmPrecision(fprop="nvfp4", dgrad="nvfp4", wgrad="nvfp4")
    for lin in tr.model.lins:
        lin.set_precision(plan)
    x = torch.randn(T, K)
    snap = truth.measure(tr, [x, torch.randn(T, K)], ("bf16", "nvfp4"), step=5)
    assert all(lin.precision == plan for lin in tr.model.lins)
    assert snap["kind"] == "truth" and snap["num_batches"] == 2 and snap["step"] == 5
    for key in ("0.fc1", "0.fc2"):
        assert snap["linears"][key]["bf16"] == {"dl": 0.0, "dw_dgrad": 0.0, "dw_wgrad": 0.0}
        assert snap["linears"][key]["nvfp4"]["dl"] != 0.0 and snap["linears"][key]["nvfp4"]["dw_wgrad"] > 0
    # fc1 is the first linear: its dgrad (dL/dX) reaches no parameter, so no update changes.
    assert snap["linears"]["0.fc1"]["nvfp4"]["dw_dgrad"] == 0.0
    assert snap["linears"]["0.fc2"]["nvfp4"]["dw_dgrad"] > 0.0
    # The loss change is that of one linear's fprop alone, as an independent forward gives it.
    with torch.no_grad():
        for lin in tr.model.lins:
            lin.set_precision(GemmPrecision())
        base = float(tr.forward_loss(x))
        tr.model.lins[0].set_precision(GemmPrecision(fprop="nvfp4"))
        alone = float(tr.forward_loss(x)) - base
    assert truth.loss_changes(tr, ("nvfp4",), [x])["0.fc1", "nvfp4"][0] == alone


def test_a_wgrad_update_change_is_the_hand_computed_adamw_one():
    """One linear, AdamW state m = 0, √v̂ = 0.2 everywhere: u = m̂'/(√v̂'+eps) with m' = (1−β1)·g,
    v' = β2·v + (1−β2)·g², for g = G_ᵀX in BF16 and in fp8 (E5M2 G, E4M3 X, quantized along
    the tokens as the wgrad GEMM does); rel 1e-4 for fp32 rounding of two norms."""
    tr = QuadraticTrainer()
    step, v_hat = 10, 0.04
    tr.set_adam_state(v_hat=v_hat, step=step)
    x = torch.randn(T, K)
    w = tr.model.lins[0].weight.detach()
    g = C * (x @ w.t() - x @ tr.target_map.t())
    dw = g.t() @ x
    dw_q = quantize(g.t().contiguous(), "fp8", Operand.GRADIENT) @ quantize(x.t().contiguous(), "fp8", Operand.ACTIVATION).t()
    b1, b2 = tr.optimizer.param_groups[0]["betas"]
    t = step + 1

    def direction(grad):
        m = (1 - b1) * grad / (1 - b1**t)
        v = (b2 * v_hat * (1 - b2**step) + (1 - b2) * grad * grad) / (1 - b2**t)
        return m / (v.sqrt() + 1e-8)

    expected = float((direction(dw_q) - direction(dw)).norm() / direction(dw).norm())
    measured = truth.update_changes(tr, ("fp8",), [x], gemms=("wgrad",))["0.fc2", "fp8", "wgrad"][0]
    assert measured == pytest.approx(expected, rel=1e-4)


def _truth_snapshot(dl, dw=0.01):
    """A measured-divergence snapshot of 2 blocks × 4 linears from {key: {format: ΔL}} (one batch)."""
    keys = [f"{layer}.{lin}" for layer in range(2) for lin in ("qkv", "proj", "fc1", "fc2")]
    return {"kind": "truth", "step": 3, "num_batches": 1, "formats": ["fp8", "nvfp4"],
            "linears": {k: {f: {"dl": dl.get(k, {}).get(f, 0.001 if f == "fp8" else 0.01),
                                "dw_dgrad": dw, "dw_wgrad": dw} for f in ("fp8", "nvfp4")} for k in keys}}


def test_truth_costs_shift_a_measured_gain_and_refuse_snip_statistics():
    """A format whose measured fprop lowers the loss costs 0 there (the per-fprop shift keeps costs
    >= 0 and their differences); SNIP's statistics are refused as truth, and a truth snapshot as SNIP's, by name."""
    costs = truth_costs(_truth_snapshot({"1.fc2": {"fp8": 0.002, "nvfp4": -0.004}}))
    fprop = costs[GemmId(1, "fc2", "fprop")]
    assert fprop["nvfp4"] == 0.0 and fprop["fp8"] > 0
    assert all(c >= 0 for per_f in costs.values() for c in per_f.values())
    other = costs[GemmId(0, "qkv", "fprop")]  # measured 0.001 (fp8) and 0.01 (nvfp4), no gain: unshifted
    assert other["nvfp4"] / other["fp8"] == pytest.approx(10)
    assert fprop["fp8"] / other["fp8"] == pytest.approx(6)  # 0.002 − (−0.004) against 0.001
    assert policy_costs("truth", _truth_snapshot({"1.fc2": {"fp8": 0.002, "nvfp4": -0.004}})) == costs
    with pytest.raises(ValueError, match="truth policy's costs need a snip.truth.measure snapshot"):
        truth_costs({"step": 3, "linears": {}})
    with pytest.raises(ValueError, match=r"measured divergences \(a run of policy truth\)"):
        policy_costs("snip", _truth_snapshot({}))


def test_the_truth_policy_protects_what_the_measurement_says_hurts():
    """At rho = 0.75 over 2 blocks of equal linears, 2 of 8 linears may stay out of FP4: the two
    whose measured NVFP4 loss change is largest."""
    numel = {"qkv": 100, "proj": 100, "fc1": 100, "fc2": 100}
    ctx = PlanContext(num_layers=2, linear_numel=numel, formats=("fp8", "nvfp4"), fp4_target=0.75, granularity="layer")
    costs = policy_costs("truth", _truth_snapshot({"0.proj": {"nvfp4": 0.5}, "1.fc1": {"nvfp4": 0.4}}))
    plan = make_plan("truth", ctx, costs).as_dict()
    kept = sorted({(g.layer, g.linear) for g, f in plan.items() if f == "fp8"})
    assert kept == [(0, "proj"), (1, "fc1")]


def test_the_controller_plans_with_measured_divergences(small_overrides):
    """On the trainer: a re-plan with policy truth measures on snip.truth_batches batches, applies
    a plan at the target and records the measured snapshot and its timings."""
    cfg = load_config("launch/configs/tiny.toml", small_overrides + [
        "snip.enabled=true", "snip.policy=truth", "snip.truth_batches=1", "snip.formats=['fp8', 'nvfp4']",
        "snip.fp4_target=0.5", "training.micro_batch_size=2", "training.global_batch_size=2"])
    tr = Trainer(cfg)
    tr.train_step(0)
    outcome = SnipController(cfg, tr).replan(tr, 1)
    assert outcome.applied and outcome.snapshot["kind"] == "truth" and outcome.snapshot["num_batches"] == 1
    assert {"truth_loss_s", "truth_update_s", "stats_s"} <= set(outcome.timings)
    assert outcome.plan.fp4_flops_share >= 0.5 and outcome.plan.policy == "truth"
    assert len(outcome.snapshot["linears"]) == 4 * cfg.model.num_layers
    tr.logger.close()


def test_the_truth_policy_needs_one_process():
    assert parse_policy("truth").policy.statistics == "truth"
    truth.check_single_process(1, "snip.policy='truth'")
    with pytest.raises(ValueError, match=r"snip.policy='truth'.*world of 2 ranks.*parallel.tp = parallel.pp = 1"):
        truth.check_single_process(2, "snip.policy='truth'")


def test_the_controller_refuses_the_truth_policy_on_several_ranks(small_overrides):
    """The controller checks the world before training starts, naming the policy it refuses."""
    from types import SimpleNamespace

    from megatron_snip.parallel.topology import ParallelTopology

    cfg = load_config("launch/configs/tiny.toml", small_overrides + ["snip.enabled=true", "snip.policy=truth",
                                                                      "snip.formats=['fp8', 'nvfp4']"])
    host = SimpleNamespace(topo=ParallelTopology.from_rank(2, 0, tp=1, pp=1), extra_state={})
    with pytest.raises(ValueError, match=r"snip.policy='truth'.*world of 2 ranks"):
        SnipController(cfg, host)
    SnipController(cfg, SimpleNamespace(topo=ParallelTopology.single(), extra_state={}))  # one process: accepted


def _run(small_overrides, tmp_path, policy):
    """A 2-step run of ``policy`` re-planning at step 1 (both policies see the same weights there)."""
    from megatron_snip.training.run import run_training

    overrides = [o for o in small_overrides if not o.startswith("training.run_dir")] + [
        f"training.run_dir={tmp_path / policy}", "snip.enabled=true", f"snip.policy={policy}", "snip.truth_batches=1",
        "snip.formats=['fp8', 'nvfp4']", "snip.fp4_target=0.5", "snip.warmup=1", "snip.interval=100",
        "snip.probe_batches=1", "snip.noise_draws=1", "training.max_steps=2", "training.eval_interval=100"]
    run_training(load_config("launch/configs/tiny.toml", overrides))
    return tmp_path / policy


def test_plan_regret_scores_plans_with_the_measured_divergences(small_overrides, tmp_path):
    """experiments/plan_regret.py rebuilds the costs the truth run planned with (its plan's recorded
    objective is checked against them), SNIP's plan and the random plans at the same target have
    regret >= 0 against that optimum, and a run of another policy is refused as the truth."""
    from experiments import plan_regret

    truth_dir, snip_dir = _run(small_overrides, tmp_path, "truth"), _run(small_overrides, tmp_path, "snip")
    table = plan_regret.regret_table(truth_dir, {"snip": snip_dir}, step=1, randoms=20)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| plan")}
    assert rows["truth-optimal"][2] == "+0.0000" and rows["truth-optimal"][3] == "1.00"
    assert float(rows["snip"][2]) >= -1e-6 and float(rows["random (mean of 20)"][2]) >= -1e-6
    stats = truth_dir / "plans" / "step_000001_stats.json"
    snap = json.loads(stats.read_text())
    for per_format in snap["linears"].values():  # FP8's wgrad changes measured as 0: not what the plan was solved with
        per_format["fp8"]["dw_wgrad"] = 0.0
    stats.write_text(json.dumps(snap))
    with pytest.raises(ValueError, match="do not belong together"):
        plan_regret.regret_table(truth_dir, {}, step=1, randoms=0)
    with pytest.raises(ValueError, match="must be a run of policy truth"):
        plan_regret.regret_table(snip_dir, {}, step=1, randoms=0)
    assert plan_regret.main(["--truth", str(truth_dir), "--plan", "snip"]) == 2
