"""The SNIP integer program against two independent exact solvers (brute force, DP)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from ilp_oracle import dp_oracle

from megatron_snip.model import shapes as model_shapes
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import GemmId, all_gemm_ids
from megatron_snip.snip import ilp

# Small integer K*N so brute force / DP stay tiny but weights still differ per linear.
SMALL_NUMEL = {"qkv": 3, "proj": 2, "fc1": 5, "fc2": 4}
FORMAT_SETS = [("fp8", "nvfp4"), ("bf16", "fp8", "nvfp4"), ("bf16", "fp8", "mxfp4", "nvfp4")]


def random_costs(gids, formats, rng, p_forbid=0.0):
    """costs[g][f] ~ U(0, 1); with probability p_forbid a (GEMM, format) is disallowed (inf)."""
    out = {}
    for g in gids:
        row = {f: float(rng.uniform(0, 1)) for f in formats}
        for f in formats:
            if rng.uniform() < p_forbid:
                row[f] = math.inf
        if all(v == math.inf for v in row.values()):
            row[formats[0]] = 0.5
        out[g] = row
    return out


def brute_force(p: ilp.Problem) -> float:
    """Minimum objective over every assignment meeting the constraints, in exact rationals."""
    from fractions import Fraction

    rho = Fraction(repr(p.fp4_target))
    total = sum(u.flops for u in p.units)
    stages = p.stages if p.per_stage else []
    best = math.inf
    allowed = [[j for j, c in enumerate(row) if c < math.inf] for row in p.cost]
    for choice in itertools.product(*allowed):
        fp4 = [p.formats[j] in FP4_FORMATS for j in choice]
        if sum(u.flops for u, f in zip(p.units, fp4) if f) < rho * total:
            continue
        ok = True
        for s in stages:
            st = [(u.flops, f) for u, f in zip(p.units, fp4) if u.stage == s]
            if sum(w for w, f in st if f) < rho * sum(w for w, _ in st):
                ok = False
                break
        if ok and p.time_cost is not None:  # time cap globally and on every stage
            budget = Fraction(repr(p.time_budget)) * Fraction(repr(p.time_cost["bf16"]))
            for s in [None, *stages]:
                sel = [(u, j) for u, j in zip(p.units, choice) if s is None or u.stage == s]
                t = sum(u.flops * Fraction(repr(p.time_cost[p.formats[j]])) for u, j in sel)
                ok = ok and t <= budget * sum(u.flops for u, _ in sel)
        if ok:
            best = min(best, math.fsum(p.cost[i][j] for i, j in enumerate(choice)))
    return best


def tolerance(p: ilp.Problem) -> float:
    finite = [c for row in p.cost for c in row if c < math.inf]
    return len(p.units) * max(finite) / ilp.COST_RESOLUTION + 1e-9


def assert_meets_target(p: ilp.Problem, sol: ilp.Solution) -> None:
    total = sum(u.flops for u in p.units)
    fp4 = sum(u.flops for u in p.units if sol.unit_assignment[u.name] in FP4_FORMATS)
    assert fp4 / total >= p.fp4_target
    assert sol.fp4_share == pytest.approx(fp4 / total)
    if p.per_stage:
        for s in p.stages:
            assert sol.per_stage_share[s] >= p.fp4_target
    for u, row in zip(p.units, p.cost):  # never picks a disallowed format
        assert row[p.formats.index(sol.unit_assignment[u.name])] < math.inf


def instances():
    """(seed, formats, granularity, staged) combinations with brute-forceable sizes."""
    for seed in range(4):
        for formats in FORMAT_SETS:
            for granularity in ("gemm", "layer"):
                for staged in (False, True):
                    yield seed, formats, granularity, staged


def make_problem(seed, formats, granularity, staged, rho=None, p_forbid=0.1):
    rng = np.random.default_rng(seed)
    # Brute force over |F|^units: keep units <= ~9 (gemm) and a mix of layers/linears.
    if granularity == "gemm":
        n_units = {2: 9, 3: 7, 4: 6}[len(formats)]
        gids = all_gemm_ids(2)
        gids = sorted(rng.choice(len(gids), n_units, replace=False))
        gids = [all_gemm_ids(2)[i] for i in gids]
    else:
        gids = all_gemm_ids(2)  # 8 layer-units
        if len(formats) == 4:
            gids = [g for g in gids if g.linear != "fc1"]  # 6 layer-units
    stage_of_layer = {0: 0, 1: 1} if staged else None
    rho = float(rng.choice([0.3, 0.5, 0.6, 0.75])) if rho is None else rho
    c = random_costs(gids, list(formats), rng, p_forbid)
    return ilp.build_problem(c, SMALL_NUMEL, formats, rho, granularity, stage_of_layer)


@pytest.mark.parametrize("seed,formats,granularity,staged", list(instances()))
def test_cpsat_matches_brute_force_and_dp(seed, formats, granularity, staged):
    p = make_problem(seed, formats, granularity, staged)
    best = brute_force(p)
    sol = ilp.solve(p)
    dp = dp_oracle(p)
    if best == math.inf:
        assert sol.status == "INFEASIBLE" and dp.status == "INFEASIBLE"
        assert "fp4_target" in sol.message or "no allowed format" in sol.message
        return
    assert sol.status == "OPTIMAL", sol.message
    assert dp.status == "OPTIMAL"
    assert dp.objective == pytest.approx(best, abs=1e-12)
    assert sol.objective == pytest.approx(best, abs=tolerance(p))
    assert_meets_target(p, sol)
    assert_meets_target(p, dp)


@pytest.mark.parametrize("seed", range(3))
def test_time_budget_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    formats = ("bf16", "fp8", "nvfp4")
    gids = [all_gemm_ids(2)[i] for i in sorted(rng.choice(24, 8, replace=False))]
    c = random_costs(gids, list(formats), rng)
    p = ilp.build_problem(
        c, SMALL_NUMEL, formats, 0.3, "gemm", {0: 0, 1: 1},
        time_cost={"bf16": 1.0, "fp8": 0.5, "nvfp4": 0.25}, time_budget=0.45,
    )
    best = brute_force(p)
    sol, dp = ilp.solve(p), dp_oracle(p)
    assert best < math.inf
    assert sol.status == "OPTIMAL" and dp.status == "OPTIMAL"
    assert dp.objective == pytest.approx(best, abs=1e-12)
    assert sol.objective == pytest.approx(best, abs=tolerance(p))
    for s in (0, 1):
        units = [u for u in p.units if u.stage == s]
        t = sum(u.flops * p.time_cost[sol.unit_assignment[u.name]] for u in units)
        assert t <= 0.45 * sum(u.flops for u in units) + 1e-9


def test_realistic_shapes_cpsat_matches_dp():
    """Real K*N (divided by their gcd inside the model) and 4 stages over 8 layers."""
    numel = model_shapes.linear_numel(model_shapes.linear_shapes(512, 1408, 8, 2))
    rng = np.random.default_rng(7)
    formats = ("fp8", "nvfp4")
    gids = all_gemm_ids(8)
    p = ilp.build_problem(random_costs(gids, list(formats), rng), numel, formats, 0.75, "layer",
                          {layer: layer // 2 for layer in range(8)})
    sol, dp = ilp.solve(p), dp_oracle(p)
    assert sol.status == dp.status == "OPTIMAL"
    assert sol.objective == pytest.approx(dp.objective, abs=tolerance(p))
    assert_meets_target(p, sol)


def test_infeasible_target_names_the_stage():
    gids = all_gemm_ids(2)
    c = {g: {"fp8": 0.1, "nvfp4": 1.0 if g.layer == 0 else math.inf} for g in gids}
    # nvfp4 only allowed on layer 1 = stage 1: 50% globally, 0% on stage 0.
    p = ilp.build_problem(c, SMALL_NUMEL, ("fp8", "nvfp4"), 0.4, "gemm", {0: 1, 1: 0})
    sol = ilp.solve(p)
    assert sol.status == "INFEASIBLE" and not sol.ok and sol.assignment == {}
    assert "fp4_target=0.4" in sol.message and "on stage 0" in sol.message and "0.0000%" in sol.message
    msg = r"the FP4 candidates \['nvfp4'\] cover at most 50.0000% of the linear FLOPs"
    with pytest.raises(ilp.InfeasibleError, match=msg):
        ilp.check_problem(ilp.build_problem(c, SMALL_NUMEL, ("fp8", "nvfp4"), 0.6, "gemm"))
    # Without stages 0.4 is achievable.
    assert ilp.solve(ilp.build_problem(c, SMALL_NUMEL, ("fp8", "nvfp4"), 0.4, "gemm")).status == "OPTIMAL"


def test_check_feasible_config_level():
    with pytest.raises(ilp.InfeasibleError, match=r"fp4_target=0.5 cannot be met: no FP4 format"):
        ilp.check_feasible(["bf16", "fp8"], 0.5)
    ilp.check_feasible(["bf16", "fp8"], 0.0)
    ilp.check_feasible(["fp8", "nvfp4"], 1.0)
    with pytest.raises(ValueError, match="'fp5' is unknown"):
        ilp.check_feasible(["fp8", "fp5"], 0.5)
    with pytest.raises(ilp.InfeasibleError, match="time_budget=0.2 cannot be met"):
        ilp.check_feasible(["fp8", "nvfp4"], 0.5, time_cost={"bf16": 1, "fp8": 0.5, "nvfp4": 0.25}, time_budget=0.2)
    ilp.check_feasible(["fp8", "nvfp4"], 0.5, time_cost={"bf16": 1, "fp8": 0.5, "nvfp4": 0.25}, time_budget=0.4)


def test_jointly_infeasible_reported_by_solver():
    gids = all_gemm_ids(1)
    c = {g: {"bf16": 0.0, "fp8": 0.1, "nvfp4": 1.0} for g in gids}
    tc = {"bf16": 1.0, "fp8": 0.5, "nvfp4": 0.25}
    # Weights 3,2,5,4 per linear: FP4 needs... a share >= 0.9 AND time <= 0.2 can't both hold.
    p = ilp.build_problem(c, SMALL_NUMEL, ("bf16", "fp8", "nvfp4"), 0.0, "gemm", time_cost=tc, time_budget=0.2)
    sol = ilp.solve(p)
    assert sol.status == "INFEASIBLE" and "time_budget=0.2" in sol.message
    p2 = ilp.build_problem(c, SMALL_NUMEL, ("bf16", "fp8"), 0.0, "gemm", time_cost=tc, time_budget=0.45)
    assert ilp.solve(p2).status == "INFEASIBLE"  # fastest allowed (fp8) needs 0.5


def test_exact_target_boundary():
    """rho=0.9 is read as 9/10: an assignment with exactly 90% FP4 FLOPs is feasible."""
    gids = [GemmId(i, "qkv", "fprop") for i in range(10)]
    c = {g: {"fp8": 0.0, "nvfp4": 1.0} for g in gids}
    p = ilp.build_problem(c, SMALL_NUMEL, ("fp8", "nvfp4"), 0.9, "gemm")
    sol = ilp.solve(p)
    assert sol.status == "OPTIMAL" and sol.fp4_share == 0.9 and sol.objective == 9.0


def test_deterministic_and_warm_start():
    numel = model_shapes.linear_numel(model_shapes.linear_shapes(1024, 2816, 16, 4))
    rng = np.random.default_rng(3)
    formats = ("bf16", "fp8", "mxfp4", "nvfp4")
    gids = all_gemm_ids(16)
    p = ilp.build_problem(random_costs(gids, list(formats), rng), numel, formats, 0.75, "gemm",
                          {layer: layer // 4 for layer in range(16)})
    a, b = ilp.solve(p), ilp.solve(p)
    assert a.status == "OPTIMAL"
    assert a.assignment == b.assignment and a.objective == b.objective
    # Warm start from the optimum (by GemmId, as a previous plan gives it) and from a
    # poor but feasible start (all nvfp4): same optimum; an unknown hint format is skipped.
    warm = ilp.solve(p, warm_start=a.assignment)
    assert warm.status == "OPTIMAL" and warm.objective == pytest.approx(a.objective, abs=tolerance(p))
    poor = {g: "nvfp4" for g in gids} | {gids[0]: "fp8_block"}
    warm2 = ilp.solve(p, warm_start=poor)
    assert warm2.status == "OPTIMAL" and warm2.objective == pytest.approx(a.objective, abs=tolerance(p))
    assert_meets_target(p, a)


def test_timeout_status_without_solution():
    """A deterministic limit too small to find anything -> TIMEOUT, no assignment (reproducible limit)."""
    numel = model_shapes.linear_numel(model_shapes.linear_shapes(1024, 2816, 16, 4))
    rng = np.random.default_rng(5)
    formats = ("bf16", "fp8", "mxfp4", "nvfp4")
    p = ilp.build_problem(random_costs(all_gemm_ids(32), list(formats), rng), numel, formats, 0.75, "gemm",
                          {layer: layer // 4 for layer in range(32)})
    sol = ilp.solve(p, max_deterministic_time=1e-9)
    assert sol.status == "TIMEOUT"
    assert not sol.ok and sol.assignment == {} and sol.objective is None and "keep the previous plan" in sol.message


def test_pareto_curve_monotone():
    rng = np.random.default_rng(11)
    formats = ("fp8", "nvfp4")
    gids = all_gemm_ids(4)
    c = random_costs(gids, list(formats), rng)
    c[gids[0]]["nvfp4"] = math.inf  # so rho = 1 is infeasible
    p = ilp.build_problem(c, SMALL_NUMEL, formats, 0.0, "gemm")
    pts = ilp.pareto_curve(p, [0.0, 0.25, 0.5, 0.75, 1.0])
    assert [r for r, _ in pts] == [0.0, 0.25, 0.5, 0.75, 1.0]
    objs = [o for _, o in pts]
    assert objs[-1] == math.inf
    assert all(x <= y + 1e-9 for x, y in itertools.pairwise(objs))
    assert objs[2] == pytest.approx(dp_oracle(p.with_target(0.5)).objective, abs=tolerance(p))


def test_pareto_curve_over_the_time_budget():
    """The sweep over the GEMM-time budget (the FP4 floor held): infeasible below the fastest mix, the
    optimum non-increasing as the budget loosens, each point the DP oracle's optimum at that budget."""
    rng = np.random.default_rng(12)
    formats = ("bf16", "fp8", "nvfp4")
    c = random_costs(all_gemm_ids(2), list(formats), rng)
    tc = {"bf16": 1.0, "fp8": 0.5, "nvfp4": 0.25}
    p = ilp.build_problem(c, SMALL_NUMEL, formats, 0.5, "gemm", time_cost=tc, time_budget=1.0)
    budgets = [0.2, 0.3, 0.5, 0.7, 1.0]
    sols = ilp.pareto_solutions(p, budgets, over="time_budget")
    assert [b for b, _ in sols] == budgets and not sols[0][1].ok  # all NVFP4 (0.25) is the fastest
    objs = [o for _, o in ilp.pareto_curve(p, budgets, over="time_budget")]
    assert objs[0] == math.inf and all(x >= y - tolerance(p) for x, y in itertools.pairwise(objs))
    for b, sol in sols[1:]:
        assert sol.fp4_share >= 0.5
        assert sol.objective == pytest.approx(dp_oracle(replace(p, time_budget=b)).objective, abs=tolerance(p))
    with pytest.raises(ValueError, match="over='rho'"):
        ilp.pareto_curve(p, budgets, over="rho")
    with pytest.raises(ValueError, match="needs a problem with time_cost"):
        ilp.pareto_curve(replace(p, time_cost=None, time_budget=None), budgets, over="time_budget")


def test_build_problem_validation():
    gids = all_gemm_ids(1)
    good = {g: {"fp8": 0.1, "nvfp4": 0.2} for g in gids}
    with pytest.raises(ValueError, match="granularity='block'"):
        ilp.build_problem(good, SMALL_NUMEL, ("fp8", "nvfp4"), 0.5, "block")
    with pytest.raises(ValueError, match="cost of unit 0.qkv.fprop in fp8 is nan"):
        ilp.build_problem(good | {gids[0]: {"fp8": math.nan, "nvfp4": 0.1}}, SMALL_NUMEL, ("fp8", "nvfp4"), 0.5)
    with pytest.raises(ValueError, match="cost of unit 0.qkv.fprop in fp8 is -1"):
        ilp.build_problem(good | {gids[0]: {"fp8": -1.0, "nvfp4": 0.1}}, SMALL_NUMEL, ("fp8", "nvfp4"), 0.5)
    with pytest.raises(ValueError, match="linear_numel lacks"):
        ilp.build_problem(good, {"qkv": 1}, ("fp8", "nvfp4"), 0.5)
    with pytest.raises(ValueError, match="stage_of_layer has no stage for layer"):
        ilp.build_problem(good, SMALL_NUMEL, ("fp8", "nvfp4"), 0.5, stage_of_layer={5: 0})
    with pytest.raises(ValueError, match="granularity='layer' ties"):
        ilp.build_problem({gids[0]: {"fp8": 0.1}}, SMALL_NUMEL, ("fp8", "nvfp4"), 0.5, "layer")
    with pytest.raises(ValueError, match=r"time_cost\['nvfp4'\]"):
        ilp.build_problem(good, SMALL_NUMEL, ("fp8", "nvfp4"), 0.5, time_cost={"bf16": 1, "fp8": 0.5}, time_budget=0.5)
    # Layer granularity adds the three GEMM costs and triples the FLOP weight.
    p = ilp.build_problem(good, SMALL_NUMEL, ("fp8", "nvfp4"), 0.5, "layer")
    assert [u.name for u in p.units] == ["0.qkv", "0.proj", "0.fc1", "0.fc2"]
    assert p.units[0].flops == 3 * SMALL_NUMEL["qkv"] and p.cost[0] == pytest.approx((0.3, 0.6))
