"""The SNIP ILP's test oracle: an exact dynamic program, independent of CP-SAT.

Used by test_ilp.py and test_policies.py to check ``ilp.solve`` on small instances whose
optimum it finds by exhaustion (house rule 4). It reads the problem through the same
exact integer form of the constraints as the solver (``problem._constraints``: FLOP weights
over their gcd, right-hand sides rounded conservatively) and evaluates the original float
costs, so its optimum is the true one.
"""

from __future__ import annotations

import math

from megatron_snip.snip.ilp import InfeasibleError, Problem, Solution, _solution, check_problem
from megatron_snip.snip.problem import _constraints


def dp_oracle(problem: Problem, *, max_states: int = 2_000_000) -> Solution:
    """Exact dynamic program over the (integer) FP4-FLOP budget - an oracle for tests.

    Units are processed stage by stage. A state is (global FP4 weight capped at its
    right-hand side, this stage's FP4 weight capped at its right-hand side, global
    time, this stage's time); it keeps the cheapest choice prefix reaching it. At a
    stage boundary states that miss the stage's targets are dropped. Costs are the
    original floats (no scaling), weights the exact integers, so the result is the
    true optimum. Exponential in the worst case: for small instances only.
    """
    try:
        check_problem(problem)
    except InfeasibleError as e:
        return Solution(status="INFEASIBLE", message=str(e))
    p, c = problem, _constraints(problem)
    order = sorted(range(len(p.units)), key=lambda i: (p.units[i].stage or 0, i))
    tinf = 0 if c.time_rhs is None else c.time_rhs
    States = dict[tuple[int, int, int, int], tuple[float, tuple[int, ...]]]
    states: States = {(0, 0, 0, 0): (0.0, ())}

    def close_stage(states: States, stage: int | None) -> States:
        if not p.per_stage:
            return states
        fp4_rhs = c.stage_fp4_rhs[stage]
        t_rhs = c.stage_time_rhs.get(stage, math.inf)
        closed: States = {}
        for (g4, s4, t, st), v in states.items():
            key = (g4, 0, t, 0)  # distinct states can merge here: keep the cheapest
            if s4 >= fp4_rhs and st <= t_rhs and (key not in closed or v[0] < closed[key][0]):
                closed[key] = v
        return closed

    for pos, i in enumerate(order):
        w, stage = c.weight[i], p.units[i].stage
        s_rhs = c.stage_fp4_rhs.get(stage, 0)
        new: States = {}
        for (g4, s4, t, st), (cost, prefix) in states.items():
            for j, ok in enumerate(c.allowed[i]):
                if not ok:
                    continue
                d4 = w if c.is_fp4[j] else 0
                dt = 0 if c.time_int is None else w * c.time_int[j]
                if c.time_rhs is not None and t + dt > tinf:
                    continue
                key = (min(g4 + d4, c.fp4_rhs), min(s4 + d4, s_rhs), t + dt, st + dt)
                val = cost + p.cost[i][j]
                if key not in new or val < new[key][0]:
                    new[key] = (val, prefix + (j,))
        if len(new) > max_states:
            raise ValueError(f"dp_oracle: {len(new)} states exceed max_states={max_states}; use a smaller instance")
        states = new
        last_of_stage = pos + 1 == len(order) or p.units[order[pos + 1]].stage != stage
        if last_of_stage:
            states = close_stage(states, stage)
    finals = [v for (g4, _, _, _), v in states.items() if g4 >= c.fp4_rhs]
    if not finals:
        return Solution(status="INFEASIBLE", message="the targets cannot be met together (dp_oracle)")
    _, prefix = min(finals, key=lambda v: v[0])
    choice = [0] * len(p.units)
    for i, j in zip(order, prefix):
        choice[i] = j
    return _solution(p, choice, "OPTIMAL")
