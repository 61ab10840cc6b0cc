"""The GEMM-time target (issue #23): time costs per GPU, the budget in every policy, BF16 as a candidate.

Checks in exact rational arithmetic (``Fraction``): a budget is read as the decimal it prints as,
so a plan exactly on the budget is feasible and nothing above it is (as for the FP4 floor).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from megatron_snip.config import SnipConfig, load_config
from megatron_snip.model import shapes as model_shapes
from megatron_snip.parallel.topology import stage_of_layer
from megatron_snip.precision import capability
from megatron_snip.precision.backends import support
from megatron_snip.precision.plan import GemmId, all_gemm_ids
from megatron_snip.snip import ilp
from megatron_snip.snip.policies import PlanContext, make_plan, policy_costs

NUM_LAYERS = 4
NUMEL = model_shapes.linear_numel(model_shapes.linear_shapes(128, 384, 4, 2))
HOPPER = {"bf16": 1.0, "fp8": 0.5}
BUDGETED = ("snip", "min_rel_err", "bf16_ends", "layer_type", "random")  # every policy held to the budget
H100 = capability.GPUS["h100"].sm
B200 = capability.GPUS["b200"].sm


def _dec(x: float) -> Fraction:
    return Fraction(repr(float(x)))


def ctx(formats=("bf16", "fp8"), budget=0.6, time_cost=HOPPER, *, rho=0.0, pp=1, granularity="layer", **kw):
    return PlanContext(num_layers=NUM_LAYERS, linear_numel=NUMEL, formats=formats, fp4_target=rho,
                       granularity=granularity, stage_of_layer=stage_of_layer(NUM_LAYERS, pp), seed=5,
                       time_cost=time_cost, time_budget=budget, fair_share=True, **kw)


def costs(formats, seed=0, **fixed):
    """Seeded positive costs (BF16 zero, the reference); ``fixed`` pins a format's cost everywhere."""
    rng = np.random.default_rng(seed)
    return {g: {f: fixed.get(f, 0.0 if f == "bf16" else float(0.1 + rng.random())) for f in formats}
            for g in all_gemm_ids(NUM_LAYERS)}


def exact_time(entries, time_cost) -> tuple[Fraction, Fraction]:
    """(sum w*t_f, sum w*t_bf16) of ``entries`` in rationals."""
    t = sum(NUMEL[g.linear] * _dec(time_cost[f]) for g, f in entries.items())
    return t, sum(NUMEL[g.linear] for g in entries) * _dec(time_cost["bf16"])


# --------------------------------------------------------------------------------------
# The time table
# --------------------------------------------------------------------------------------
def test_time_table_datasheet_ratios_and_emulated_cost():
    hopper, blackwell = 989.0 / 67.0, 2250.0 / 80.0  # dense BF16 tensor-core / FP32 peaks (capability's sources)
    assert capability.gemm_time_costs("torch", ["fp8", "fp8_block", "nvfp4"], H100) == {
        "bf16": 1.0, "fp8": 0.5, "fp8_block": 0.5, "nvfp4": hopper}
    assert capability.gemm_time_costs("te", ["fp8", "mxfp8", "nvfp4", "mxfp4"], B200) == {
        "bf16": 1.0, "fp8": 0.5, "mxfp8": 0.5, "nvfp4": 0.25, "mxfp4": blackwell}
    assert round(hopper, 1) == 14.8 and round(blackwell, 1) == 28.1  # the issue's ~15x and ~28x
    # the emulated backend emulates everything; A100 has no FP8 tensor cores
    assert capability.gemm_time_costs("emulated", ["fp8"], H100)["fp8"] == hopper
    assert capability.gemm_time_costs("te", ["fp8"], capability.GPUS["a100"].sm)["fp8"] == 312.0 / 19.5
    assert all(r > 1.0 for r in capability.EMULATED_GEMM_TIME_RATIO.values())
    # an older GPU (V100, sm_70): BF16 is the reference, everything else emulated (Ampere's figure stands in)
    assert capability.gemm_time_costs("torch", ["fp8"], (7, 0)) == {"bf16": 1.0, "fp8": 312.0 / 19.5}


@pytest.mark.parametrize("padded_api", [False, True], ids=["torch without padded scales", "with them"])
def test_the_shape_rule_prices_each_gemm(padded_api, monkeypatch):
    """torch backend, fp8_block, 70B at TP=8 on H100: qkv's dgrad has K = 1280 (K/128 = 10, not a
    multiple of 4: cuBLAS's 128x128 scale padding). On a torch without the padded-scale API
    (``scaled_mm_rules.padded_scale_api``) it runs emulated and is priced so; with it, natively like
    every other GEMM, at the datasheet ratio. Checked against the shape rule itself, whichever torch
    this machine has (the model prices with the installed torch's API)."""
    from megatron_snip.precision import scaled_mm_rules
    from megatron_snip.precision.gemm_shapes import gemm_operands
    from megatron_snip.precision.scaled_mm_rules import scaled_mm_shape_error
    from megatron_snip.sizing import dry_run_report, estimate
    from megatron_snip.sizing.gemm_time import GemmPrices

    monkeypatch.setattr(scaled_mm_rules, "padded_scale_api", lambda: (padded_api, "as the test sets it"))
    cfg = load_config("launch/configs/llama_70b.toml", ['precision.backend="torch"'])
    sizing = estimate(cfg, 64, "h100")
    prices = GemmPrices(cfg, sizing, ["fp8_block"])
    assert prices.emulated("fp8_block") == ([] if padded_api else ["qkv.dgrad"])
    local = model_shapes.local_linear_shapes(model_shapes.model_linear_shapes(cfg.model), 8)
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    refusals = 0
    for lin in ("qkv", "proj", "fc1", "fc2"):
        for g in ("fprop", "dgrad", "wgrad"):
            (_, ak, a), (_, bk, b) = gemm_operands(g, *local[lin], tokens)
            refused = scaled_mm_shape_error("fp8_block", a, ak, b, bk, "cuda") is not None
            refusals += refused
            assert prices.cost[("fp8_block", lin, g)] == (989.0 / 67.0 if refused else 0.5)
    assert refusals == (0 if padded_api else 1)
    numel = model_shapes.linear_numel(model_shapes.model_linear_shapes(cfg.model))
    emulated_qkv = 0 if padded_api else numel["qkv"] * (989.0 / 67.0 - 0.5)
    expected = (sum(numel.values()) * 3 * 0.5 + emulated_qkv) / (sum(numel.values()) * 3)
    assert prices.ratio("fp8_block") == pytest.approx(expected, rel=1e-12)
    text = dry_run_report(cfg, 64, "h100")
    assert ("fp8_block runs emulated for qkv.dgrad" in text) == (not padded_api)
    if not padded_api:
        assert "cheapest achievable 0.549" in text  # qkv stays BF16: its three GEMMs together cost more in fp8_block


# --------------------------------------------------------------------------------------
# Exactness
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("t_fp8, budget, fp8_units", [(0.5, 0.6, 8), (0.3, 0.37, 9), (0.7, 0.79, 7)])
def test_budget_met_exactly_is_feasible(t_fp8, budget, fp8_units):
    """Budgets whose boundary is not a float (1 - 9*0.07 = 0.37000000000000005 in floats): a plan
    exactly on the budget is feasible, for the ILP and for the static rules alike."""
    gids = [GemmId(i, "qkv", "fprop") for i in range(10)]
    tc = {"bf16": 1.0, "fp8": t_fp8}
    p = ilp.build_problem({g: {"bf16": 0.0, "fp8": 1.0} for g in gids}, NUMEL, ("bf16", "fp8"), 0.0, "gemm",
                          time_cost=tc, time_budget=budget)
    sol = ilp.solve(p)
    assert sol.status == "OPTIMAL" and sol.objective == fp8_units  # the fewest fp8 GEMMs the budget allows
    t, ref = exact_time(sol.assignment, tc)
    assert t == _dec(budget) * ref  # on the budget, exactly
    # The static rules on a whole model: within budget exactly, never one unit past it.
    c = ctx(time_cost=tc, budget=budget, granularity="gemm")
    for spec in ("bf16_ends", "layer_type", "random"):
        t, ref = exact_time(make_plan(spec, c).as_dict(), tc)
        assert t <= _dec(budget) * ref


# --------------------------------------------------------------------------------------
# Every policy within one decision unit of the budget
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["layer", "gemm"])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("budget", [0.6, 0.75, 0.9])
def test_hopper_set_every_policy_within_one_unit_of_the_budget(granularity, pp, budget):
    """["bf16", "fp8"] at a GEMM-time budget: on every stage the plan's time is <= the budget and
    short of it by less than one decision unit's BF16-minus-FP8 time (else one more unit could
    stay in BF16). The ILP gets that from minimizing positive FP8 costs; the static policies from
    fair_share's protect-until-the-budget-binds."""
    c = ctx(budget=budget, pp=pp, granularity=granularity)
    for spec in BUDGETED:
        plan = make_plan(spec, c, costs(c.formats, seed=pp))
        entries = plan.as_dict()
        assert set(entries.values()) <= {"bf16", "fp8"}
        unit = 3 if granularity == "layer" else 1
        stage_of = c.stage_of_layer or dict.fromkeys(range(NUM_LAYERS), 0)
        for stage in set(stage_of.values()):
            mine = {g: f for g, f in entries.items() if stage_of[g.layer] == stage}
            t, ref = exact_time(mine, HOPPER)
            slack = _dec(budget) * ref - t
            biggest = max(NUMEL.values()) * unit * (_dec(HOPPER["bf16"]) - _dec(HOPPER["fp8"]))
            assert 0 <= slack < biggest, (spec, stage, float(slack / ref))
        t, ref = exact_time(entries, HOPPER)
        assert dict(plan.extra)["gemm_time_ratio"] == pytest.approx(float(t / ref), rel=1e-12)
        assert t <= _dec(budget) * ref


def test_uniform_reports_its_cost_and_bf16_is_a_candidate():
    c = ctx(budget=0.6)
    assert dict(make_plan("uniform:fp8", c).extra)["gemm_time_ratio"] == 0.5
    assert dict(make_plan("uniform:bf16", c).extra)["gemm_time_ratio"] == 1.0  # reported, not refused
    assert dict(make_plan("bf16", c).extra)["gemm_time_ratio"] == 1.0


# --------------------------------------------------------------------------------------
# Emulated formats
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0.6, 0.8, 1.0, 1.2])
def test_emulated_format_never_chosen_for_a_time_budget(budget):
    """On H100 with the torch backend NVFP4 runs emulated (slower than BF16): no policy picks it, even
    when it is the cheapest format in error. On B200 under TE it is native and is picked (so the
    check can fail)."""
    formats = ("bf16", "fp8", "nvfp4")
    c = ctx(formats, budget, capability.gemm_time_costs("torch", formats, H100))
    assert c.candidates == ("bf16", "fp8")
    attractive = costs(formats, nvfp4=0.0, bf16=0.05)
    for spec in BUDGETED:
        assert "nvfp4" not in make_plan(spec, c, attractive).as_dict().values(), spec
    blackwell = ctx(formats, budget, capability.gemm_time_costs("te", formats, B200))
    assert "nvfp4" in make_plan("snip", blackwell, attractive).as_dict().values()


def test_infeasible_budget_names_the_cheapest_ratio():
    with pytest.raises(ilp.InfeasibleError, match=r"fastest mix needs 0\.5 of BF16 time"):
        ctx(budget=0.4)
    # Every candidate emulated (the emulated backend): the cheapest achievable is named too.
    tc = capability.gemm_time_costs("emulated", ["fp8", "nvfp4"], H100)
    with pytest.raises(ilp.InfeasibleError, match=r"slower than BF16.*cheapest achievable is 14\.76"):  # 989/67: H100
        ctx(("fp8", "nvfp4"), 0.9, tc)
    # A static rule whose fast candidate alone cannot meet the budget names its own cheapest ratio.
    mixed = {"bf16": 1.0, "fp8": 0.5, "fp8_block": 0.75}
    c = ctx(("bf16", "fp8_block", "fp8"), 0.6, mixed)  # the ILP can reach 0.5 with fp8
    assert make_plan("snip", c, costs(c.formats)).extra


def test_config_target_and_run_time_costs():
    cfg = load_config("launch/configs/tiny.toml", ['snip.target="gemm_time"', 'snip.formats=["bf16", "fp8"]',
                                                   "snip.time_budget=0.6", 'snip.time_costs=["bf16=1", "fp8=0.5"]'])
    cfg.validate(1)  # no FP4 format needed under gemm_time
    c = PlanContext.for_run(cfg.snip, NUM_LAYERS, NUMEL, 1)
    assert c.fp4_target == 0.0 and c.time_budget == 0.6 and dict(c.time_cost) == HOPPER
    # Without time costs the target GPU's table is used; a CPU run has none: a clear error.
    bare = SnipConfig(target="gemm_time", formats=("bf16", "fp8"), time_budget=0.6)
    assert dict(PlanContext.for_run(bare, NUM_LAYERS, NUMEL, 1, backend="torch", sm=H100).time_cost) == HOPPER
    if support.device_compute_capability() is None:
        with pytest.raises(ValueError, match="snip.time_costs"):
            PlanContext.for_run(bare, NUM_LAYERS, NUMEL, 1)
    both = SnipConfig(target="both", formats=("fp8", "nvfp4"), fp4_target=0.5, time_budget=0.4)
    c = PlanContext.for_run(both, NUM_LAYERS, NUMEL, 1, backend="te", sm=B200)
    plan = make_plan("snip", c, costs(c.formats))
    assert plan.fp4_flops_share >= 0.5 and dict(plan.extra)["gemm_time_ratio"] <= 0.4
    for bad, match in ((['snip.target="speed"'], "snip.target"), (["snip.time_budget=0"], "snip.time_budget"),
                       (['snip.time_costs=["fp8=0.5"]'], "bf16=<ratio>"), (['snip.time_costs=["fp8"]'], "fp8")):
        with pytest.raises(ValueError, match=match):
            load_config(None, bad)
    with pytest.raises(ValueError, match=r"snip.time_costs.*\['fp8'\]"):
        load_config(None, ["snip.enabled=true", 'snip.target="gemm_time"', 'snip.formats=["bf16", "fp8"]',
                           'snip.time_costs=["bf16=1"]']).validate(1)


def test_bf16_costs_are_zero():
    """BF16 is the zero-error reference: whatever the probe pass measured for it (under autocast its
    reference and its 'quantized' GEMM round differently), the costs a policy minimizes say 0."""
    pf = {k: 1e-6 for k in ("sq_ey", "sq_edx", "sq_edw")}
    snap = {"linears": {"0.qkv": {"sq_y": 1.0, "sq_dx": 1.0, "sq_dw": 1.0,
                                  "per_format": {"bf16": pf, "fp8": {k: 0.01 for k in pf}}}}}
    got = policy_costs("min_rel_err", snap)
    assert all(c["bf16"] == 0.0 and c["fp8"] == pytest.approx(0.1) for c in got.values())
    assert not math.isnan(sum(c["fp8"] for c in got.values()))


# --------------------------------------------------------------------------------------
# The dry run
# --------------------------------------------------------------------------------------
WORLD = {"tiny": 1, "llama_1b": 8, "llama_3b": 8, "llama_7b": 16, "llama_70b": 64}


@pytest.mark.parametrize("gpu", ["h100", "b200"])
@pytest.mark.parametrize("name", sorted(WORLD))
def test_dry_run_prints_what_each_shipped_config_buys(name, gpu):
    from megatron_snip.sizing import dry_run_report

    cfg = load_config(f"launch/configs/{name}.toml")
    text = dry_run_report(cfg, WORLD[name], gpu)
    assert "initial plan bf16: 1 of BF16 GEMM time, 0% of linear FLOPs emulated" in text
    assert "SNIP target" in text and "of BF16 GEMM time" in text
    hopper_configs = ("llama_3b", "llama_7b", "llama_70b")  # their comment names H100/H200
    if name in hopper_configs or (name == "llama_1b" and gpu == "b200"):
        assert "SLOWER" not in text and "INFEASIBLE" not in text  # none models slower than BF16 on its GPU


def test_dry_run_warns_when_a_plan_is_slower_than_bf16():
    """The 70B config as it was (fp8 + nvfp4 at 75% FP4, torch backend) models slower than BF16 on H100:
    its NVFP4 GEMMs run emulated there."""
    from megatron_snip.sizing import dry_run_report

    cfg = load_config("launch/configs/llama_70b.toml", ['snip.target="fp4_share"', "snip.fp4_target=0.75",
                                                        'snip.formats=["fp8", "nvfp4"]'])
    text = dry_run_report(cfg, 64, "h100")
    # 0.75 x 989/67 (nvfp4 emulated: an fp32 GEMM) + 0.25 x 0.5 (fp8) = 11.2
    assert "at best 11.2 of BF16 GEMM time" in text and "at least 75% of linear FLOPs emulated" in text
    assert "WARNING: this plan would run SLOWER than BF16 on H100 (11.2x)" in text


def test_gpu_time_ratios_script_smoke(capsys):
    """scripts/gpu_time_ratios.py (the device check of the table) runs end to end on CPU toy shapes."""
    import importlib.util
    import sys
    from pathlib import Path

    scripts = Path(__file__).parents[2] / "scripts"
    sys.path.insert(0, str(scripts))  # as when it runs from there: it imports gpu_check_runs
    path = scripts / "gpu_time_ratios.py"
    spec = importlib.util.spec_from_file_location("gpu_time_ratios", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--reps", "1", "--formats", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "bf16       measured  1.00   table 1" in out and "fp8        measured" in out and "table 0.5" in out
    assert "as a config: --set 'snip.time_costs=[\"bf16=1\", \"fp8=" in out  # the measurement replaces the table
