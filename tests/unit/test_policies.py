"""Baseline and SNIP policies: one interface, same FP4 target, clear errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from ilp_oracle import dp_oracle

from megatron_snip.model import shapes as model_shapes
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import LINEARS, GemmId, PrecisionPlan, all_gemm_ids
from megatron_snip.snip import ilp
from megatron_snip.snip.policies import (
    POLICIES,
    POLICY_FORMS,
    PlanContext,
    SolveTimeoutError,
    make_plan,
    needs_costs,
    parse_policy,
)

NUM_LAYERS = 6
# TinyLlama-like block: d=2048, ffn 5632, 32 heads, 4 KV heads.
NUMEL = model_shapes.linear_numel(model_shapes.linear_shapes(2048, 5632, 32, 4))
STAGES = {layer: layer // 3 for layer in range(NUM_LAYERS)}
TARGETED = ["bf16_ends", "tail", "attn_protected", "mlp_only", "layer_type", "layer_type:fc2", "layer_type:fc2,proj,qkv", "random", "min_rel_err", "snip"]
EXEMPT = ["bf16", "uniform:fp8"]


def ctx(rho=0.75, formats=("fp8", "nvfp4"), **kw):
    return PlanContext(num_layers=NUM_LAYERS, linear_numel=NUMEL, formats=formats, fp4_target=rho, **kw)


def random_costs(seed=0, formats=("fp8", "nvfp4")):
    rng = np.random.default_rng(seed)
    return {g: {f: float(rng.uniform(0, 1)) for f in formats} for g in all_gemm_ids(NUM_LAYERS)}


def stage_share(plan: PrecisionPlan, stage: int) -> float:
    d = {g: f for g, f in plan.entries if STAGES[g.layer] == stage}
    total = sum(NUMEL[g.linear] for g in d)
    return sum(NUMEL[g.linear] for g, f in d.items() if f in FP4_FORMATS) / total


@pytest.mark.parametrize("rho", [0.5, 0.75, 0.9])
@pytest.mark.parametrize("granularity", ["gemm", "layer"])
@pytest.mark.parametrize("spec", TARGETED)
def test_every_policy_meets_rho(spec, granularity, rho):
    c = ctx(rho, granularity=granularity, stage_of_layer=STAGES)
    plan = make_plan(spec, c, costs=random_costs() if needs_costs(spec) else None)
    plan.validate(all_gemm_ids(NUM_LAYERS))
    assert plan.policy == spec and plan.step == 0
    assert plan.fp4_flops_share >= rho
    assert set(plan.format_counts()) <= {"fp8", "nvfp4"}
    assert dict(plan.extra)["fp4_target"] == rho
    if spec in ("snip", "min_rel_err", "random"):  # these also honour the per-stage target
        assert min(stage_share(plan, 0), stage_share(plan, 1)) >= rho
    if needs_costs(spec):
        assert plan.solver_status == "OPTIMAL" and plan.objective is not None
    else:
        assert plan.solver_status is None and plan.objective is None
    if granularity == "layer":  # a linear's three GEMMs share a format
        for layer in range(NUM_LAYERS):
            for lin in LINEARS:
                assert len(set(plan.for_linear(layer, lin).__dict__.values())) == 1


@pytest.mark.parametrize("spec", EXEMPT)
def test_exempt_policies_say_so(spec):
    plan = make_plan(spec, ctx(0.9))
    assert plan.fp4_flops_share == 0.0
    assert "exempt from fp4_target" in dict(plan.extra)["note"]
    assert set(plan.format_counts()) == {spec.split(":")[-1]}
    # Exempt policies don't need an FP4 candidate at all.
    assert make_plan(spec, ctx(0.9, formats=("bf16", "fp8"))).fp4_flops_share == 0.0


def test_uniform_fp4_meets_any_rho():
    plan = make_plan("uniform:nvfp4", ctx(1.0))
    assert plan.fp4_flops_share == 1.0 and "note" not in dict(plan.extra)


def test_bf16_ends_exact_ends():
    plan = make_plan("bf16_ends:2,1", ctx(0.5, formats=("bf16", "fp8", "nvfp4")))
    for g, f in plan.entries:
        assert f == ("bf16" if g.layer in (0, 1, 5) else "nvfp4"), g
    assert plan.fp4_flops_share == pytest.approx(3 / 6)
    # High-precision candidate is the non-FP4 format when bf16 is not listed.
    plan = make_plan("bf16_ends:0,2", ctx(0.5, formats=("nvfp4", "fp8")))
    assert {f for g, f in plan.entries if g.layer >= 4} == {"fp8"}
    assert {f for g, f in plan.entries if g.layer < 4} == {"nvfp4"}
    assert dict(plan.extra)["ends_first"] == 0 and dict(plan.extra)["ends_last"] == 2
    with pytest.raises(ValueError, match="keeps 7 blocks in high precision but the model has only num_layers=6"):
        make_plan("bf16_ends:4,3", ctx())


@pytest.mark.parametrize("rho,ends", [(0.3, 2), (0.5, 1), (0.6, 1), (0.7, 0), (0.9, 0)])
def test_bf16_ends_auto_picks_largest_symmetric_ends(rho, ends):
    plan = make_plan("bf16_ends", ctx(rho))
    extra = dict(plan.extra)
    assert extra["ends_first"] == extra["ends_last"] == ends
    assert plan.fp4_flops_share == pytest.approx((NUM_LAYERS - 2 * ends) / NUM_LAYERS)


def test_layer_type_protects_then_moves_middle_out():
    # qkv+fc1 alone are ~64% of the FLOPs: rho=0.5 overshoots (kept), rho=0.75 moves protected units.
    low = make_plan("layer_type", ctx(0.5))
    assert all((f == "fp8") == (g.linear in ("fc2", "proj")) for g, f in low.entries)
    assert low.fp4_flops_share > 0.6
    high = make_plan("layer_type", ctx(0.75, granularity="layer"))
    moved_layers = {g.layer for g, f in high.entries if g.linear in ("fc2", "proj") and f == "nvfp4"}
    assert moved_layers and moved_layers <= {2, 3}, moved_layers  # the middle blocks go first
    # Within a block the last-listed type (proj) moves before fc2.
    moved = {(g.layer, g.linear) for g, f in high.entries if f == "nvfp4" and g.linear in ("fc2", "proj")}
    assert (2, "proj") in moved


def test_random_deterministic_per_seed():
    a = make_plan("random", ctx(0.75, seed=1))
    b = make_plan("random", ctx(0.75, seed=1))
    c = make_plan("random", ctx(0.75, seed=2))
    assert a.entries == b.entries and a.hash == b.hash
    assert a.entries != c.entries
    assert dict(a.extra)["seed"] == 1


def test_snip_uses_costs_and_warm_start():
    costs = random_costs(3)
    c = ctx(0.75, stage_of_layer=STAGES)
    plan = make_plan("snip", c, costs)
    # The plan is the ILP optimum of those costs (checked against the DP oracle).
    p = ilp.build_problem(costs, NUMEL, c.formats, 0.75, "gemm", STAGES)
    assert plan.objective == pytest.approx(dp_oracle(p).objective, abs=len(p.units) / ilp.COST_RESOLUTION)
    again = make_plan("snip", PlanContext(**{**c.__dict__, "step": 200}), costs, previous=plan)
    assert again.entries == plan.entries and again.step == 200 and again.solver_status == "OPTIMAL"
    # min_rel_err is the same ILP on different costs: with these costs the same answer.
    assert make_plan("min_rel_err", c, costs).entries == plan.entries
    # Plans round-trip through JSON (extra values are plain scalars).
    assert PrecisionPlan.from_json_dict(json.loads(plan.to_json())) == plan


def test_snip_timeout_keeps_previous_plan():
    costs = random_costs(4)
    first = make_plan("snip", ctx(0.75), costs)
    tight = ctx(0.75, step=300, max_deterministic_time=1e-9)
    kept = make_plan("snip", tight, random_costs(5), previous=first)
    assert kept.entries == first.entries and kept.hash == first.hash and kept.step == first.step
    assert kept.solver_status == "TIMEOUT"
    assert "kept the plan from step 0" in dict(kept.extra)["solver_message"]
    with pytest.raises(SolveTimeoutError, match="no previous plan to keep"):
        make_plan("snip", tight, costs)


def test_infeasible_rho_rejected():
    with pytest.raises(ilp.InfeasibleError, match="fp4_target=0.75 cannot be met: no FP4 format"):
        make_plan("snip", ctx(0.75, formats=("bf16", "fp8")), random_costs(0, ("bf16", "fp8")))
    with pytest.raises(ilp.InfeasibleError, match="no FP4 format"):
        make_plan("random", ctx(0.5, formats=("bf16", "fp8")))
    # nvfp4 forbidden on stage 0's layers: the message names the stage.
    costs = random_costs(1)
    for g in costs:
        if STAGES[g.layer] == 0:
            costs[g]["nvfp4"] = math.inf
    with pytest.raises(ilp.InfeasibleError, match=r"fp4_target=0.5 cannot be met: .* on stage 0"):
        make_plan("snip", ctx(0.5, stage_of_layer=STAGES), costs)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("unifrom:fp8", "unknown policy 'unifrom:fp8'"),
        ("uniform:fp9", "format 'fp9' is unknown"),
        ("uniform", "format '' is unknown"),
        ("uniform:", "empty argument"),
        ("bf16_ends:2", r"bf16_ends:<first>,<last>"),
        ("bf16_ends:a,b", r"bf16_ends:<first>,<last>"),
        ("bf16_ends:-1,2", r"bf16_ends:<first>,<last>"),
        ("layer_type:fc3", r"bad: \['fc3'\]"),
        ("layer_type:fc2,fc2", "duplicates"),
        ("snip:fast", "policy 'snip' takes no arguments"),
        ("random:3", "policy 'random' takes no arguments"),
        ("", "unknown policy ''"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_needs_costs_and_cost_validation():
    assert needs_costs("snip") and needs_costs("min_rel_err")
    assert not any(needs_costs(s) for s in ["bf16", "uniform:nvfp4", "bf16_ends:1,1", "layer_type", "random"])
    with pytest.raises(ValueError, match="needs costs"):
        make_plan("snip", ctx())
    partial = random_costs()
    del partial[GemmId(5, "fc2", "wgrad")]
    with pytest.raises(ValueError, match=r"missing \['5.fc2.wgrad'\]"):
        make_plan("snip", ctx(), partial)
    # Static policies ignore costs.
    assert make_plan("random", ctx(), random_costs()).entries == make_plan("random", ctx()).entries


def test_context_validation():
    with pytest.raises(ValueError, match="num_layers=0"):
        PlanContext(num_layers=0, linear_numel=NUMEL, formats=("fp8", "nvfp4"), fp4_target=0.5)
    with pytest.raises(ValueError, match="fp4_target=75"):
        ctx(75)
    with pytest.raises(ValueError, match="fp4_target=1.5"):  # the one validation of rho on its way to the ILP
        ctx(1.5)
    with pytest.raises(ValueError, match="granularity='block'"):
        ctx(granularity="block")
    with pytest.raises(ValueError, match=r"stage_of_layer has no stage for layer\(s\) \[5\]"):
        ctx(stage_of_layer={i: 0 for i in range(5)})


def test_registry_says_which_statistics_each_policy_needs():
    """The controller runs the passes a policy's registry entry names: SNIP's costs need the noise
    passes (curvature, propagation), the local-error baseline only pass 1, the truth oracle its own
    measurements, the rest nothing."""
    assert {name: p.statistics for name, p in POLICIES.items()} == {
        "bf16": None, "uniform": None, "bf16_ends": None, "tail": None, "attn_protected": None, "mlp_only": None,
        "layer_type": None, "random": None,
        "min_rel_err": "errors", "snip": "all", "truth": "truth"}
    assert all(parse_policy(form.split(":<")[0] if ":<" in form else form).name == name
               for name, p in POLICIES.items() for form in p.forms if form != "uniform:<format>")
    assert POLICY_FORMS[0] == "bf16" and POLICY_FORMS[-2:] == ("snip", "truth")


def test_plan_context_for_run_takes_config_and_stages():
    from megatron_snip.config import SnipConfig

    snip = SnipConfig(formats=("fp8", "nvfp4"), fp4_target=0.5, granularity="gemm", seed=3, solver_max_time=2.0)
    c = PlanContext.for_run(snip, NUM_LAYERS, NUMEL, 2, step=7)
    assert (c.formats, c.fp4_target, c.granularity, c.seed, c.step, c.max_deterministic_time) == \
        (("fp8", "nvfp4"), 0.5, "gemm", 3, 7, 2.0)
    assert dict(c.stage_of_layer) == STAGES
    assert PlanContext.for_run(snip, NUM_LAYERS, NUMEL, 1).stage_of_layer is None
    assert PlanContext.for_run(snip, NUM_LAYERS, NUMEL, 1, fp4_target=0.9).fp4_target == 0.9
    with pytest.raises(ValueError, match="snip.fp4_target"):  # overrides are validated as the config is
        PlanContext.for_run(snip, NUM_LAYERS, NUMEL, 1, fp4_target=1.5)


# --- fair_share: every static policy within one decision unit above rho -----------------------
FAIR = ["bf16_ends", "layer_type", "layer_type:fc2", "random"]


def _unit_weights(granularity: str) -> list[int]:
    return [NUMEL[lin] * (3 if granularity == "layer" else 1) for lin in LINEARS]


@pytest.mark.parametrize("spec", FAIR)
@pytest.mark.parametrize("granularity", ["layer", "gemm"])
@pytest.mark.parametrize("rho", [0.3, 0.5, 0.75, 0.8, 0.9])
def test_fair_share_lands_within_one_decision_unit_above_rho(spec, granularity, rho):
    total = sum(NUMEL.values()) * 3 * NUM_LAYERS
    for stages in (None, STAGES):
        plan = make_plan(spec, ctx(rho, granularity=granularity, fair_share=True, stage_of_layer=stages, seed=3))
        lightest_fp4 = min(NUMEL[g.linear] * (3 if granularity == "layer" else 1)
                           for g, f in plan.entries if f in FP4_FORMATS)
        assert rho <= plan.fp4_flops_share < rho + lightest_fp4 * (2 if stages else 1) / total, (spec, stages)
        if stages:
            for stage in (0, 1):  # each stage meets rho, over by less than one of its units
                assert rho <= stage_share(plan, stage) < rho + max(_unit_weights(granularity)) * 2 / total


def test_fair_layer_type_keeps_its_rule_where_it_can():
    # The rule alone (fc2, proj high) gives 0.64 > 0.5: fair_share protects more, the rule's types first.
    rule, fair = make_plan("layer_type", ctx(0.5)), make_plan("layer_type", ctx(0.5, fair_share=True))
    assert rule.fp4_flops_share > 0.6 and 0.5 <= fair.fp4_flops_share < 0.51
    assert all(f == "fp8" for g, f in fair.entries if g.linear in ("fc2", "proj"))
    # At 0.9 the rule misses rho; the protected types move to FP4, the middle blocks first
    fair9 = dict(make_plan("layer_type", ctx(0.9, fair_share=True)).entries)
    protected_ends = [fair9[GemmId(layer, "fc2", "fprop")] for layer in (0, NUM_LAYERS - 1)]
    assert protected_ends == ["fp8", "fp8"] and all(f in FP4_FORMATS for g, f in fair9.items() if g.linear == "fc1")


def test_fair_bf16_ends_is_the_recipe_when_whole_blocks_fit():
    # 6 blocks at rho = 4/6: exactly the first and last block in high precision, as without fair_share
    rho = 4 / 6
    assert make_plan("bf16_ends", ctx(rho, fair_share=True)).entries == make_plan("bf16_ends", ctx(rho)).entries
    # at 0.8 the rule gives up the ends entirely (share 1.0); fair_share protects the ends unit by unit
    assert make_plan("bf16_ends", ctx(0.8)).fp4_flops_share == 1.0
    fair = make_plan("bf16_ends", ctx(0.8, fair_share=True))
    assert 0.8 <= fair.fp4_flops_share < 0.85
    assert any(f == "fp8" for g, f in fair.entries if g.layer == 0)


def test_fair_share_comes_from_the_config():
    from megatron_snip.config import load_config

    cfg = load_config("launch/configs/tiny.toml", ["snip.fair_share=true", "snip.fp4_target=0.5"])
    numel = model_shapes.linear_numel(model_shapes.model_linear_shapes(cfg.model))
    c = PlanContext.for_run(cfg.snip, cfg.model.num_layers, numel, pp=1)
    assert c.fair_share and make_plan("layer_type", c).fp4_flops_share < 0.6
