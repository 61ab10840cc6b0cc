"""The SNIP integer program: pick one format per decision unit, minimizing total cost
subject to an FP4 FLOP-share target (globally and per pipeline stage).

Pure module: no ranks, no logging, no clocks other than what the solver reports.

Model (one Boolean x[u, f] per unit u and allowed candidate format f)::

    minimize    sum_{u,f} cost[u][f] * x[u, f]
    subject to  sum_f x[u, f] = 1                                      for every unit u
                sum_{u, f in FP4} w_u * x[u, f] >= rho * sum_u w_u       (globally)
                ... the same restricted to the units of each stage s      (if per_stage)
                sum_{u,f} w_u t_f x[u, f] <= B * sum_u w_u t_bf16         (optional time budget,
                                                                           globally and per stage)

``w_u`` is the unit's FLOP weight: the sum of K*N over its GEMMs (every GEMM of a
linear with weight (N, K) costs 2*T*K*N FLOPs; 2*T cancels). A cost of ``math.inf``
(or a format missing from a GEMM's cost mapping) means "not allowed for this unit",
e.g. a format whose block size does not divide the layer's sharded dims.

The problem and its exact integer constraints (FLOP weights over their gcd, targets
read as the decimals they print as, right-hand sides rounded conservatively) live in
``snip/problem.py``; this module solves it and reads the solution back.

Objective scaling (CP-SAT is an integer solver):
  * Costs are rounded to integers ``round(c * COST_RESOLUTION / max_finite_cost)``.
    Each unit's rounding error is at most ``max_cost / (2 * COST_RESOLUTION)``, so the
    returned objective (always re-evaluated in the original float costs) is within
    ``num_units * max_cost / COST_RESOLUTION`` of the true float optimum.

Solver settings (chosen by benchmark, docs/bench/README.md): ``num_workers=1``,
``linearization_level=2``, fixed ``random_seed`` and a *deterministic* time limit
(``max_deterministic_time``, not wall-clock) - this proves optimality on
knapsack-like instances quickly and gives identical answers run to run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import GemmId
from megatron_snip.snip.problem import (
    GRANULARITIES,
    InfeasibleError,
    Problem,
    Unit,
    _constraints,
    build_problem,
    check_feasible,
    check_formats,
    check_problem,
    check_share,
)

COST_RESOLUTION = 1_000_000


# --------------------------------------------------------------------------------------
# Solution
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Solution:
    """Result of ``solve`` (and of the tests' DP oracle, tests/unit/ilp_oracle.py).

    Attributes:
        status: "OPTIMAL" (proven), "FEASIBLE" (time limit hit with a solution, not proven
            optimal), "INFEASIBLE" (``message`` says which constraint) or "TIMEOUT" (no
            solution within the deterministic time limit: keep the previous plan).
        assignment: GemmId -> format (empty unless OPTIMAL/FEASIBLE).
        unit_assignment: unit name -> format.
        objective: total cost in the original float costs (None without a solution).
        bound: solver's lower bound on the objective, rescaled (approximate).
        solve_time_s: solver wall time as reported by the solver.
        deterministic_time: solver's deterministic time (reproducible effort measure).
        fp4_share: FP4 FLOP share of ``assignment``.
        per_stage_share: stage -> FP4 FLOP share (empty when stages are not given).
        message: human-readable reason for non-OPTIMAL statuses.
    """

    status: str
    assignment: dict[GemmId, str] = field(default_factory=dict)
    unit_assignment: dict[str, str] = field(default_factory=dict)
    objective: float | None = None
    bound: float | None = None
    solve_time_s: float = 0.0
    deterministic_time: float = 0.0
    fp4_share: float | None = None
    per_stage_share: dict[int, float] = field(default_factory=dict)
    message: str = ""

    @property
    def ok(self) -> bool:
        """True when there is an assignment to use (OPTIMAL or FEASIBLE)."""
        return self.status in ("OPTIMAL", "FEASIBLE")


def _solution(p: Problem, choice: Sequence[int], status: str, **kw) -> Solution:
    """Package a per-unit format-index choice, re-evaluating objective and shares exactly."""
    fp4 = [p.formats[j] in FP4_FORMATS for j in choice]
    total = sum(u.flops for u in p.units)
    per_stage = {}
    for s in p.stages:
        idx = [i for i, u in enumerate(p.units) if u.stage == s]
        per_stage[s] = sum(p.units[i].flops for i in idx if fp4[i]) / sum(p.units[i].flops for i in idx)
    return Solution(
        status=status,
        assignment={g: p.formats[j] for u, j in zip(p.units, choice) for g in u.gemms},
        unit_assignment={u.name: p.formats[j] for u, j in zip(p.units, choice)},
        objective=math.fsum(p.cost[i][j] for i, j in enumerate(choice)),
        fp4_share=sum(u.flops for u, is4 in zip(p.units, fp4) if is4) / total,
        per_stage_share=per_stage,
        **kw,
    )


# --------------------------------------------------------------------------------------
# CP-SAT
# --------------------------------------------------------------------------------------
def solve(
    problem: Problem,
    *,
    warm_start: Mapping[GemmId | str, str] | None = None,
    max_deterministic_time: float = 10.0,
    num_workers: int = 1,
    seed: int = 0,
) -> Solution:
    """Solve ``problem`` with OR-Tools CP-SAT (deterministic settings, see module docstring).

    Args:
        warm_start: a previous assignment, keyed by unit name or GemmId (e.g. the
            previous plan's ``as_dict()``); a unit takes the hint of its name, else of
            its first GemmId present. Hints naming a format that is not an allowed
            candidate for the unit are skipped (e.g. a bf16 initial plan with fp8/nvfp4
            candidates). Hints only guide the search: the optimum value is the same with or
            without them (among equal-cost optima the one returned may differ).
        max_deterministic_time: CP-SAT's deterministic time limit (reproducible, not wall-clock).
        num_workers: CP-SAT search workers; keep 1 for run-to-run identical answers.
        seed: CP-SAT ``random_seed``.

    Returns:
        ``Solution``; INFEASIBLE/TIMEOUT are statuses, not exceptions (check ``.ok``).
    """
    if max_deterministic_time <= 0:
        raise ValueError(f"max_deterministic_time={max_deterministic_time} must be > 0 (CP-SAT deterministic seconds)")
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    try:
        check_problem(problem)
    except InfeasibleError as e:
        return Solution(status="INFEASIBLE", message=str(e))
    p, c = problem, _constraints(problem)

    finite = [x for row in p.cost for x in row if x < math.inf]
    scale = COST_RESOLUTION / max(finite) if max(finite) > 0 else 0.0

    model = cp_model.CpModel()
    x: list[dict[int, cp_model.IntVar]] = []
    for i, allowed in enumerate(c.allowed):
        x.append({j: model.new_bool_var(f"x_{i}_{j}") for j, ok in enumerate(allowed) if ok})
        model.add_exactly_one(x[i].values())

    def fp4_floor(idx: Iterable[int], rhs: int) -> None:
        terms = [(x[i][j], c.weight[i]) for i in idx for j in x[i] if c.is_fp4[j]]
        if rhs > 0:
            model.add(cp_model.LinearExpr.weighted_sum([v for v, _ in terms], [w for _, w in terms]) >= rhs)

    def time_cap(idx: Iterable[int], rhs: int) -> None:
        assert c.time_int is not None
        terms = [(x[i][j], c.weight[i] * c.time_int[j]) for i in idx for j in x[i]]
        model.add(cp_model.LinearExpr.weighted_sum([v for v, _ in terms], [w for _, w in terms]) <= rhs)

    stage_idx = {s: [i for i, u in enumerate(p.units) if u.stage == s] for s in p.stages}
    fp4_floor(range(len(p.units)), c.fp4_rhs)
    for s, rhs in c.stage_fp4_rhs.items():
        fp4_floor(stage_idx[s], rhs)
    if c.time_rhs is not None:
        time_cap(range(len(p.units)), c.time_rhs)
        for s, rhs in c.stage_time_rhs.items():
            time_cap(stage_idx[s], rhs)

    obj_vars = [v for xi in x for v in xi.values()]
    obj_coef = [round(p.cost[i][j] * scale) for i, xi in enumerate(x) for j in xi]
    model.minimize(cp_model.LinearExpr.weighted_sum(obj_vars, obj_coef))

    if warm_start:
        for i, unit in enumerate(p.units):
            hint = warm_start.get(unit.name)
            if hint is None:
                hint = next((warm_start[g] for g in unit.gemms if g in warm_start), None)
            if hint in p.formats and p.formats.index(hint) in x[i]:
                jh = p.formats.index(hint)
                for j, var in x[i].items():
                    model.add_hint(var, j == jh)

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = num_workers
    prm.linearization_level = 2
    prm.random_seed = seed
    prm.max_deterministic_time = max_deterministic_time
    status = solver.solve(model)
    timing = {"solve_time_s": solver.wall_time, "deterministic_time": solver.deterministic_time}

    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = [next(j for j, v in xi.items() if solver.boolean_value(v)) for xi in x]
        proven = status == cp_model.OPTIMAL
        bound = solver.best_objective_bound / scale if scale else 0.0
        msg = "" if proven else (
            f"stopped at max_deterministic_time={max_deterministic_time} before proving optimality "
            f"(objective {solver.objective_value / scale if scale else 0.0:.6g}, bound {bound:.6g})"
        )
        return _solution(p, choice, "OPTIMAL" if proven else "FEASIBLE", bound=bound, message=msg, **timing)
    if status == cp_model.INFEASIBLE:
        return Solution(
            status="INFEASIBLE",
            message=(
                f"fp4_target={p.fp4_target} and time_budget={p.time_budget} cannot be met together"
                f"{' on every stage' if p.per_stage else ''} (each alone is achievable); relax one of them"
            ),
            **timing,
        )
    if status == cp_model.UNKNOWN:
        return Solution(
            status="TIMEOUT",
            message=(
                f"no feasible assignment found within max_deterministic_time={max_deterministic_time}; "
                "keep the previous plan or raise the limit"
            ),
            **timing,
        )
    raise RuntimeError(f"CP-SAT returned {solver.status_name(status)}: {model.validate()!r} (a bug in ilp.py)")


# --------------------------------------------------------------------------------------
# Pareto sweep
# --------------------------------------------------------------------------------------
PARETO_AXES = ("fp4_target", "time_budget")  # the target a Pareto sweep varies


def pareto_solutions(problem: Problem, targets: Iterable[float], *, over: str = "fp4_target",
                     **solve_kw) -> list[tuple[float, Solution]]:
    """The optimal solution at each target: ``[(target, Solution), ...]`` in the given order.

    ``over`` names the target varied: ``"fp4_target"`` (rho) or ``"time_budget"`` (the GEMM-time
    budget; ``problem`` must have time costs), every other constraint held. Each solve is
    warm-started from the previous feasible one; an infeasible target (or a timeout without a
    solution) gives a Solution whose ``ok`` is False. ``solve_kw`` go to ``solve``.
    """
    if over not in PARETO_AXES:
        raise ValueError(f"pareto sweep over={over!r}: choose one of {PARETO_AXES}")
    if over == "time_budget" and problem.time_cost is None:
        raise ValueError("a Pareto sweep over time_budget needs a problem with time_cost (and a time_budget)")
    out: list[tuple[float, Solution]] = []
    hint: Mapping[str, str] | None = solve_kw.pop("warm_start", None)
    for target in targets:
        sol = solve(replace(problem, **{over: target}), warm_start=hint, **solve_kw)
        if sol.ok:
            hint = sol.unit_assignment
        out.append((target, sol))
    return out


def pareto_curve(problem: Problem, targets: Iterable[float], *, over: str = "fp4_target",
                 **solve_kw) -> list[tuple[float, float]]:
    """Optimal objective as a function of a target: ``[(target, objective), ...]`` in the given order.

    ``over``: ``"fp4_target"`` (rho, the default) or ``"time_budget"`` (``pareto_solutions``).
    Infeasible targets (and timeouts without a solution) get ``math.inf``; a FEASIBLE-but-unproven
    solve contributes its (upper-bound) objective.
    """
    return [(t, sol.objective if sol.ok else math.inf)
            for t, sol in pareto_solutions(problem, targets, over=over, **solve_kw)]


__all__ = [
    "COST_RESOLUTION",
    "GRANULARITIES",
    "PARETO_AXES",
    "InfeasibleError",
    "Problem",
    "Solution",
    "Unit",
    "build_problem",
    "check_feasible",
    "check_formats",
    "check_problem",
    "check_share",
    "pareto_curve",
    "pareto_solutions",
    "solve",
]
