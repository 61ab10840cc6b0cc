"""The run-level FP4 budget (``snip.budget = "run"``, ``snip/budget.py``): the allocation against a
brute-force oracle, its limits (p = 0 is the plan budget, a linear cost is bang-bang, the last
interval takes the exact remainder, infeasible and empty inputs are named), the spent budget read
from the plan history, the ``<rule>+switch`` plans, and the config's checks."""

from __future__ import annotations

import itertools
import json
import math
import random
from fractions import Fraction

import pytest

from megatron_snip.config import load_config
from megatron_snip.config.schedule import lr_at, wsd_decay_start
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import all_gemm_ids
from megatron_snip.snip import budget
from megatron_snip.snip.budget import Interval, RunBudget, allocate, intervals_from, plan_interval, share_grid
from megatron_snip.snip.policies import PlanContext, check_policy_context, cost_curve, make_plan
from megatron_snip.snip.problem import InfeasibleError
from megatron_snip.snip.rules import switch_entries
from tests.unit.snip_runs import fit_snip, preempted_and_resumed, solve_plan_script, step_losses

TINY = "launch/configs/tiny.toml"
F = Fraction


def oracle(lengths, weights, grid, curve, need):
    """The cheapest allocation by enumeration: (cost, shares)."""
    best = None
    ok = [j for j, c in enumerate(curve) if c != math.inf]
    for pick in itertools.product(ok, repeat=len(lengths)):
        if sum(n * grid[j] for n, j in zip(lengths, pick)) >= need:
            cost = sum(F(w) * n * F(curve[j]) for n, w, j in zip(lengths, weights, pick))
            if best is None or cost < best[0]:
                best = (cost, tuple(grid[j] for j in pick))
    return best


def _instance(rng, convex, equal):
    grid = share_grid(0.5, 0.9, 0.1)
    n = rng.randint(1, 4)
    lengths = [5] * n if equal else [rng.randint(1, 9) for _ in range(n)]
    weights = [F(rng.randint(4, 40), 4) for _ in range(n)]
    if convex:  # increasing marginal costs
        marg = sorted(rng.randint(0, 10) for _ in grid)
        curve = [float(sum(marg[: j + 1])) for j in range(len(grid))]
    else:  # any non-decreasing curve, one share unreachable at random
        curve = [float(c) for c in sorted(rng.randint(0, 20) for _ in grid)]
        if rng.random() < 0.3:
            curve[-1] = math.inf
    total, top = sum(lengths), max(s for s, c in zip(grid, curve) if c != math.inf)
    need = F(rng.randint(int(5 * total), int(10 * top * total)), 10)
    return lengths, weights, grid, curve, need


@pytest.mark.parametrize("convex,equal", [(True, True), (True, False), (False, False)])
def test_allocation_against_the_oracle(convex, equal):
    """The exact program equals the brute-force optimum; the Lagrangian sweep alone (``dp_limit=0``,
    what runs where the table is too large) is feasible, never cheaper than the optimum, within its
    certificate (cost <= lower_bound + gap, lower_bound <= optimum) and exact for convex costs on
    equal intervals (a separable convex resource allocation)."""
    rng = random.Random(7 + 10 * convex + equal)
    for _ in range(150):
        lengths, weights, grid, curve, need = _instance(rng, convex, equal)
        best, _ = oracle(lengths, weights, grid, curve, need)
        got = allocate(lengths, weights, grid, curve, need)
        assert got.exact and got.cost == best
        sweep = allocate(lengths, weights, grid, curve, need, dp_limit=0)
        assert not sweep.exact
        for a in (got, sweep):
            assert sum(n * s for n, s in zip(lengths, a.shares)) - need == a.overshoot >= 0
            assert a.cost == sum(F(w) * n * F(curve[grid.index(s)]) for n, w, s in zip(lengths, weights, a.shares))
        assert sweep.lower_bound <= best <= sweep.cost <= sweep.lower_bound + sweep.gap
        if convex and equal:
            assert sweep.cost == best


@pytest.mark.parametrize("dp_limit", [budget.DP_LIMIT, 0])
def test_p0_gives_the_plan_budget(dp_limit):
    """p = 0: every interval weighs the same; with a convex or a linear cost and rho on the grid each
    interval gets rho (ties broken towards equal shares), whatever the interval lengths."""
    grid = share_grid(0.5, 0.95, 0.05)
    ivs = intervals_from(10, [10, 30, 50, 70, 85], 100, lambda t: 1e-3 * (1 + t), 1e-3 * 100, 0.0)
    assert [iv.weight for iv in ivs] == [1] * 5 and [iv.length for iv in ivs] == [20, 20, 20, 15, 15]
    rho = F(3, 4)
    need = rho * 90
    for curve in (list(grid), [float(s) ** 2 for s in grid], [math.exp(float(s)) for s in grid]):
        got = allocate([iv.length for iv in ivs], [iv.weight for iv in ivs], grid, curve, need, dp_limit)
        assert got.shares == (rho,) * 5 and got.overshoot == 0


@pytest.mark.parametrize("dp_limit", [budget.DP_LIMIT, 0])
def test_a_linear_cost_is_bang_bang_fp4_early_promotion_late(dp_limit):
    """Static rules price every FP4 FLOP alike (C(s) = s): the allocation puts the largest share where the
    weight is lowest (high LR, early) and the smallest late, with at most one interval in between -
    NVIDIA's switch before decay, as the optimum of the allocation."""
    grid = share_grid(0.5, 0.95, 0.05)
    cfg = load_config(TINY, ["training.max_steps=200", "training.lr_schedule=cosine", "training.warmup_steps=0"])
    ivs = intervals_from(0, range(0, 200, 20), 200, lambda t: lr_at(t, cfg.training), cfg.training.lr, 1.0)
    assert all(a.weight < b.weight for a, b in itertools.pairwise(ivs))
    got = allocate([iv.length for iv in ivs], [iv.weight for iv in ivs], grid, list(grid), F(4, 5) * 200, dp_limit)
    shares = list(got.shares)
    assert shares == sorted(shares, reverse=True) and shares[0] == grid[-1] and shares[-1] == grid[0]
    assert sum(1 for s in shares if grid[0] < s < grid[-1]) <= 1
    assert got.overshoot < 20 * F(1, 20)  # within one grid step of one interval


def test_wsd_decay_onset_is_a_replan_and_the_promotion_happens_there():
    """Under WSD the run budget adds a re-plan at the decay onset; a static rule's allocation then holds a
    high share through the stable phase and the smallest share through the decay."""
    cfg = load_config(TINY, ["training.max_steps=100", "training.lr_schedule=wsd", "training.warmup_steps=0",
                             "snip.warmup=0", "snip.interval=30", "snip.budget=run", "snip.fp4_target=0.8"])
    rb = RunBudget.for_run(cfg)
    onset = wsd_decay_start(cfg.training)
    assert onset == 80 and rb.points == (0, 30, 60, 80, 90) and rb.is_replan_step(80)
    ivs = rb.intervals(0)
    assert [(iv.start, iv.end) for iv in ivs] == [(0, 30), (30, 60), (60, 80), (80, 90), (90, 100)]
    got = allocate([iv.length for iv in ivs], [iv.weight for iv in ivs], rb.grid, list(rb.grid), F(4, 5) * 100)
    stable, decay = got.shares[:3], got.shares[3:]
    assert decay == (rb.grid[0],) * 2  # promoted at the onset
    assert min(stable) >= F(4, 5) and sum(30 * s for s in stable[:2]) + 20 * stable[2] == 70  # 0.875 on average


def test_the_last_interval_takes_the_exact_remainder():
    grid = share_grid(0.5, 0.95, 0.05)
    history = [(0, F(0)), (10, F(9, 10)), (50, F(18, 25))]  # the initial plan before the horizon, two plans in it
    d = plan_interval(90, 0.8, (10, 100), history, [Interval(90, 100, F(3))], grid, list(grid))
    spent = F(9, 10) * 40 + F(18, 25) * 40
    assert budget.spent_share_steps(history, 10, 90) == spent
    assert d.share == (F(4, 5) * 90 - spent) / 10 == F(18, 25) and d.clamped is None and d.unspent == 0  # off-grid
    # a remainder past the grid's top is clamped, and the plan says so
    d = plan_interval(90, 0.8, (10, 100), [(10, F(1, 2))], [Interval(90, 100, F(1))], grid, list(grid))
    assert d.share == grid[-1] and "outside the reachable range" in d.clamped and d.unspent > 0
    extra = d.extra()
    assert extra["budget_interval_share"] == 0.95 and extra["run_target"] == 0.8 and "budget_note" in extra


def test_spent_counts_each_plan_until_the_next_within_the_horizon():
    history = [(0, F(1)), (5, F(1, 2)), (5, F(1, 4)), (12, F(3, 4))]  # a plan at step 5 replaced at step 5
    assert budget.spent_share_steps(history, 3, 20) == 2 * 1 + 7 * F(1, 4) + 8 * F(3, 4)
    assert budget.spent_share_steps(history, 3, 3) == 0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"share range \[0.9, 0.5\]"):
        share_grid(0.9, 0.5, 0.05)
    with pytest.raises(ValueError, match="grid step 0"):
        share_grid(0.5, 0.9, 0)
    grid = share_grid(0.5, 0.9, 0.1)
    with pytest.raises(InfeasibleError, match="largest reachable share 0.9"):
        allocate([10, 10], [1, 2], grid, list(grid), F(19))
    with pytest.raises(InfeasibleError, match="every cost infinite"):
        allocate([10], [1], grid, [math.inf] * len(grid), F(1))
    with pytest.raises(ValueError, match="one weight per interval"):
        allocate([], [], grid, list(grid), F(1))
    with pytest.raises(ValueError, match="snip.target=\"fp4_share\""):
        load_config(TINY, ["snip.budget=run", "snip.target=both"])
    with pytest.raises(ValueError, match="snip.budget_share_range.*must contain snip.fp4_target=0.75"):
        load_config(TINY, ["snip.budget=run", "snip.budget_share_range=[0.8, 0.9]"])
    with pytest.raises(ValueError, match="snip.budget_share_range"):
        load_config(TINY, ["snip.budget_share_range=[0.5]"])
    with pytest.raises(ValueError, match="snip.budget="):
        load_config(TINY, ["snip.budget=step"])
    with pytest.raises(ValueError, match="snip.budget_lr_power"):
        load_config(TINY, ["snip.budget_lr_power=-1"])


def test_an_under_spent_run_spends_all_it_can_and_says_so():
    grid = share_grid(0.5, 0.9, 0.1)
    ivs = [Interval(50, 75, F(1)), Interval(75, 100, F(2))]
    d = plan_interval(50, 0.8, (0, 100), [(0, F(1, 2))], ivs, grid, list(grid))
    assert d.share == F(9, 10) and "every interval at 0.9" in d.clamped


def _ctx(share, run_target, granularity="gemm"):
    cfg = load_config(TINY, [])
    return PlanContext(num_layers=4, linear_numel=linear_numel(model_linear_shapes(cfg.model)),
                       formats=("fp8", "nvfp4"), fp4_target=share, granularity=granularity, fair_share=True,
                       run_target=run_target)


def _share(plan):
    return plan.fp4_flops_share


@pytest.mark.parametrize("rule", ["tail", "bf16_ends", "attn_protected", "mlp_only", "random"])
def test_switch_is_the_rule_at_or_above_rho_and_promotes_fprop_first_below(rule):
    plain = make_plan(rule, _ctx(0.75, None))
    assert make_plan(f"{rule}+switch", _ctx(0.75, None)).as_dict() == plain.as_dict()  # the plan budget
    assert make_plan(f"{rule}+switch", _ctx(0.9, 0.75)).as_dict() == make_plan(rule, _ctx(0.9, None)).as_dict()
    low = make_plan(f"{rule}+switch", _ctx(0.55, 0.75))
    assert 0.55 <= _share(low) < _share(plain) and dict(low.extra)["switched"] is True
    base, promoted = plain.as_dict(), low.as_dict()
    assert all(promoted[g] == "fp8" for g, f in base.items() if f == "fp8")  # the rule's protection stays
    moved = [g for g in base if base[g] in FP4_FORMATS and promoted[g] not in FP4_FORMATS]
    assert moved and any(g.gemm == "fprop" for g in moved)
    # fprop first: a dgrad or wgrad moved only where every fprop still in FP4 was too heavy to move
    # (each unit moves if the share stays >= the target, else it is skipped: the slack only shrinks)
    numel = _ctx(0.75, None).linear_numel
    left_fprop = [g for g in base if g.gemm == "fprop" and promoted[g] in FP4_FORMATS]
    assert all(numel[h.linear] < numel[g.linear] for h in moved if h.gemm != "fprop" for g in left_fprop)


def test_switch_needs_a_rule():
    for bad in ("+switch", "uniform:nvfp4+switch", "bf16+switch", "truth+switch"):
        with pytest.raises(ValueError, match=r"'\+switch' follows a static rule or an ILP policy"):
            make_plan(bad, _ctx(0.75, None))


def _costs(seed=0):
    rng = random.Random(seed)
    return {g: {"fp8": rng.uniform(0, 0.1), "nvfp4": rng.uniform(0, 1)} for g in all_gemm_ids(4)}


def test_snip_switch_is_snip_at_or_above_rho_and_promotes_snips_plan_below():
    """snip+switch: SNIP's ILP plan at an interval share >= rho; below it, SNIP's plan at rho with FP4
    GEMMs promoted in the switch's order (fprop first) down to the interval's share; SNIP's own
    protection stays. Its cost curve is the static rules' (linear): NVIDIA's allocation in time."""
    costs = _costs()
    at_rho = make_plan("snip", _ctx(0.75, None), costs)
    assert make_plan("snip+switch", _ctx(0.75, None), costs).as_dict() == at_rho.as_dict()  # the plan budget
    high = make_plan("snip+switch", _ctx(0.9, 0.75), costs)
    assert high.as_dict() == make_plan("snip", _ctx(0.9, None), costs).as_dict()
    assert high.policy == "snip+switch" and dict(high.extra)["switched"] is False
    low = make_plan("snip+switch", _ctx(0.55, 0.75), costs)
    assert 0.55 <= _share(low) < _share(at_rho) and dict(low.extra)["switched"] is True
    base, promoted = at_rho.as_dict(), low.as_dict()
    assert all(promoted[g] == "fp8" for g, f in base.items() if f == "fp8")
    moved = [g for g in base if base[g] in FP4_FORMATS and promoted[g] not in FP4_FORMATS]
    assert moved and moved[0].gemm == "fprop"
    # the same promotion tail+switch makes, from SNIP's plan instead of the rule's
    assert promoted == switch_entries(_ctx(0.55, 0.75), base)
    grid = share_grid(0.5, 0.9, 0.1)
    assert cost_curve("snip+switch", _ctx(0.75, None), costs, grid) == list(grid)
    assert cost_curve("snip", _ctx(0.75, None), costs, grid) != list(grid)  # SNIP alone: its measured curve


def test_snip_switch_needs_two_candidates(small_overrides):
    cfg = load_config(TINY, [])
    three = PlanContext(num_layers=4, linear_numel=linear_numel(model_linear_shapes(cfg.model)),
                        formats=("bf16", "fp8", "nvfp4"), fp4_target=0.55, granularity="gemm", run_target=0.75)
    with pytest.raises(ValueError, match=r"snip.policy='snip\+switch' needs exactly two candidate formats.*'bf16', "
                                         r"'fp8', 'nvfp4'.*keep one non-FP4 format"):
        check_policy_context("snip+switch", three)
    check_policy_context("tail+switch", three)  # a static rule uses two of them by construction
    with pytest.raises(ValueError, match="needs exactly two candidate formats"):
        _fit_config(small_overrides + ["snip.policy=snip+switch", "snip.formats=[\"bf16\", \"fp8\", \"nvfp4\"]"])


# --- in a run ----------------------------------------------------------------------------
RUN = ["snip.enabled=true", "snip.warmup=2", "snip.interval=4", "snip.probe_batches=1", "snip.noise_draws=1",
       "snip.granularity=gemm", "snip.fair_share=true", "snip.budget=run", "snip.fp4_target=0.75",
       "snip.budget_share_range=[0.3, 0.95]", "training.lr_schedule=wsd", "training.max_steps=20",
       "training.log_interval=1", "training.eval_interval=100"]


def _fit_config(overrides):
    """The controller's start-up checks alone: a SnipController on the tiny config, nothing trained."""
    from megatron_snip.snip.controller import SnipController
    from megatron_snip.training.trainer import Trainer

    cfg = load_config(TINY, overrides)
    SnipController(cfg, Trainer(cfg))


def _fit(overrides, crash_after=None):
    return fit_snip(overrides, crash_after)[0]


def _run_share(plans, horizon, numel):
    history = [(p.step, budget.fp4_fraction(p.entries, numel)) for p in plans]
    return budget.spent_share_steps(history, *horizon) / (horizon[1] - horizon[0])


@pytest.mark.parametrize("policy", ["tail+switch", "snip+switch"])
def test_a_run_spends_rho_over_its_horizon(small_overrides, tmp_path, policy):
    """tail+switch (NVIDIA's recipe) and snip+switch under the run budget on the small model: the
    recorded plans' shares, weighted by the steps each was in force over [warmup, max_steps), reach rho
    and pass it by less than one decision unit's share over the last interval (its exact remainder is a
    target the fair-share rule meets within one unit); the decay onset re-planned, promoting there."""
    tr = _fit(small_overrides + RUN + [f"snip.policy={policy}"])
    numel = linear_numel(model_linear_shapes(tr.cfg.model))
    plans = tr.plan_history
    onset = wsd_decay_start(tr.cfg.training)
    assert [p.step for p in plans] == [0, 2, 6, 10, 14, onset, 18] and onset == 16
    last = dict(plans[-1].extra)
    assert "budget_note" not in last  # the last interval's exact remainder was within the range
    share = _run_share(plans, (2, 20), numel)
    unit = F(max(numel.values()), sum(numel[g.linear] for g, _ in plans[-1].entries))  # the heaviest GEMM's share
    assert F(3, 4) <= share < F(3, 4) + unit * F(20 - 18, 20 - 2)
    assert math.isclose(last["budget_unspent"], 0.0, abs_tol=1e-12)  # the recorded state agrees: nothing left
    stable, decay = dict(plans[4].extra), dict(plans[5].extra)  # the plans of steps 14 and 16 (the onset)
    assert decay["budget_interval_share"] < stable["budget_interval_share"] and decay["switched"] is True
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if "budget_unspent" in r]
    assert [r["step"] for r in rows] == [2, 6, 10, 14, 16, 18] and (tmp_path / "run" / "timeline.png").stat().st_size > 0


def test_the_budget_state_survives_a_resume_bitwise(small_overrides, tmp_path):
    """SNIP under the run budget, preempted after step 8 and resumed: the same plans (hashes), the same
    budget records (every plan.extra field, exactly: the spent share is re-derived from the
    checkpointed plan history) and the same losses as the uninterrupted run."""
    full = _fit(small_overrides + RUN + ["snip.policy=snip"])
    run2 = tmp_path / "run2"
    resumed, _ = preempted_and_resumed(small_overrides + RUN + ["snip.policy=snip"], run2, crash_after=12)
    assert [p.hash for p in resumed.plan_history] == [p.hash for p in full.plan_history]

    def budget_fields(plans):
        return [{k: v for k, v in p.extra if k.startswith("budget") or k == "run_target"} for p in plans]

    assert budget_fields(resumed.plan_history) == budget_fields(full.plan_history)
    assert any(f for f in budget_fields(full.plan_history))

    assert step_losses(run2) == step_losses(tmp_path / "run")

    # offline: scripts/solve_plan.py --run-dir answers the same share (and plan) for the step-10 interval
    mod = solve_plan_script()
    run, out = tmp_path / "run", tmp_path / "offline"
    assert mod.main(["--stats", str(run / "plans/step_000010_stats.json"), "--run-dir", str(run),
                     "--granularity", "gemm", "--out", str(out)]) == 0
    online = next(p for p in full.plan_history if p.step == 10)
    offline = json.loads((out / "budget.json").read_text())
    assert offline == {k: v for k, v in online.extra if k.startswith("budget") or k == "run_target"}
    assert json.loads((out / "plan.json").read_text())["entries"] == {g.key: f for g, f in online.entries}
    assert mod.main(["--stats", str(run / "plans/step_000010_stats.json"), "--run-dir", str(tmp_path),
                     "--out", str(out)]) == 2  # no config.toml there
