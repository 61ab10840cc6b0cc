"""The SNIP integer program's data: decision units, the problem, and its exact integer form.

Building the problem (``build_problem``, ``Problem``), checking it before any solve
(``check_feasible``, ``check_problem``) and the exact integer constraints that the
solver (``snip/ilp.py``) and the tests' DP oracle share (``_constraints``). The model
itself is stated in ``snip/ilp.py``'s docstring.

Integer scaling (CP-SAT is an integer solver), stated precisely:
  * FLOP weights are exact: K*N are integers, divided by their common gcd.
  * ``fp4_target`` and ``time_budget`` are read as the decimal numbers they print as
    (``Fraction(repr(x))``: 0.9 means 9/10) and the right-hand sides are rounded in
    the conservative direction (ceil for the FP4 floor, floor for the time cap), so a
    returned assignment satisfies the constraint exactly, in rational arithmetic.
  * ``time_cost`` values are read the same way and scaled by the lcm of their
    denominators (exact); if that lcm exceeds 10**6 they are rounded to a grid of
    1/10**6 (not exact - a documented approximation, never hit by values like 0.25).

Pure module: no ranks, no logging, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import reduce
from types import MappingProxyType

from megatron_snip.precision.formats import FORMATS, FP4_FORMATS
from megatron_snip.precision.plan import GEMMS, GRANULARITIES, LINEARS, GemmId

_TIME_GRID = 10**6

class InfeasibleError(ValueError):
    """The targets cannot be met; the message names the constraint and what is achievable."""


# --------------------------------------------------------------------------------------
# Problem
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One decision unit.

    Attributes:
        name: ``"3.fc2.wgrad"`` (granularity "gemm") or ``"3.fc2"`` (granularity "layer").
        gemms: the GemmIds that take the unit's format (1 or 3), canonical order.
        flops: FLOP weight, sum of K*N over ``gemms`` (integer; 2*T cancels).
        stage: pipeline stage of the unit's layer, or None when stages are not given.
    """

    name: str
    gemms: tuple[GemmId, ...]
    flops: int
    stage: int | None = None


@dataclass(frozen=True)
class Problem:
    """One instance of the integer program.

    Attributes:
        units: decision units (see ``Unit``).
        formats: candidate format names, e.g. ("fp8", "nvfp4"); may include "bf16".
        cost: ``cost[u][f]`` for unit index u and format index f; >= 0, ``math.inf``
            = format not allowed for that unit.
        fp4_target: rho in [0, 1]: FP4 share of the FLOPs must be >= rho (validated at the
            boundary, ``policies.PlanContext``; asserted here).
        per_stage: also require the FP4 share (and the time budget) on every stage.
        time_cost: optional per-format relative cost per FLOP (e.g. bf16 1.0,
            fp8 0.5, nvfp4 0.25); must cover every candidate and "bf16" (the reference).
        time_budget: with ``time_cost``: sum w*t_f <= time_budget * sum w*t_bf16.
        granularity: "gemm" or "layer" (informational; units already reflect it).
    """

    units: tuple[Unit, ...]
    formats: tuple[str, ...]
    cost: tuple[tuple[float, ...], ...]
    fp4_target: float
    per_stage: bool = False
    time_cost: Mapping[str, float] | None = None
    time_budget: float | None = None
    granularity: str = "gemm"

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        object.__setattr__(self, "formats", tuple(self.formats))
        object.__setattr__(self, "cost", tuple(tuple(float(c) for c in row) for row in self.cost))
        if not self.units:
            raise ValueError("Problem.units is empty; there must be at least one decision unit")
        check_formats(self.formats)
        assert 0.0 <= self.fp4_target <= 1.0, f"fp4_target={self.fp4_target!r} (validated by PlanContext)"
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} must be one of {GRANULARITIES}")
        if len(self.cost) != len(self.units) or any(len(r) != len(self.formats) for r in self.cost):
            raise ValueError(
                f"Problem.cost must be {len(self.units)} units x {len(self.formats)} formats; "
                f"got {len(self.cost)} rows of lengths {sorted({len(r) for r in self.cost})}"
            )
        for unit, row in zip(self.units, self.cost):
            for fmt, c in zip(self.formats, row):
                if math.isnan(c) or c < 0 or c == -math.inf:
                    raise ValueError(
                        f"cost of unit {unit.name} in {fmt} is {c}; costs must be >= 0 (inf = not allowed)"
                    )
            if unit.flops <= 0:
                raise ValueError(f"unit {unit.name} has flops={unit.flops}; FLOP weights must be positive integers")
        if self.per_stage and any(u.stage is None for u in self.units):
            raise ValueError("per_stage=True needs a stage for every unit; pass stage_of_layer")
        if (self.time_cost is None) != (self.time_budget is None):
            raise ValueError("time_cost and time_budget go together; pass both (or neither)")
        if self.time_cost is not None:
            object.__setattr__(self, "time_cost", MappingProxyType(dict(self.time_cost)))
            for fmt in (*self.formats, "bf16"):
                t = self.time_cost.get(fmt)
                if t is None or not (0 < t < math.inf):
                    raise ValueError(
                        f"time_cost[{fmt!r}]={t!r}; time_cost needs a positive finite relative cost per FLOP "
                        f"for every candidate format and for 'bf16' (the reference), e.g. bf16 1.0, fp8 0.5, nvfp4 0.25"
                    )
            if not (0 < self.time_budget < math.inf):
                raise ValueError(f"time_budget={self.time_budget!r} must be a positive fraction of BF16 time")

    @property
    def stages(self) -> list[int]:
        """Sorted distinct stages (empty when stages are not given)."""
        return sorted({u.stage for u in self.units if u.stage is not None})

    def with_target(self, fp4_target: float) -> Problem:
        return replace(self, fp4_target=fp4_target)


def check_formats(formats: Sequence[str]) -> None:
    """ValueError unless ``formats`` is a non-empty list of distinct known format names."""
    if not formats:
        raise ValueError("formats is empty; list the candidate formats, e.g. ['fp8', 'nvfp4']")
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"candidate format {f!r} is unknown; choose from {sorted(FORMATS)}")
    if len(set(formats)) != len(formats):
        raise ValueError(f"formats={list(formats)} lists a format twice")


def check_share(name: str, value: float) -> None:
    """ValueError unless ``value`` (argument/field ``name``) is a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0):
        raise ValueError(f"{name}={value!r} must be a number in [0, 1] (a share of linear-layer FLOPs)")


def build_problem(
    costs: Mapping[GemmId, Mapping[str, float]],
    linear_numel: Mapping[str, int],
    formats: Sequence[str],
    fp4_target: float,
    granularity: str = "gemm",
    stage_of_layer: Mapping[int, int] | None = None,
    *,
    per_stage: bool | None = None,
    time_cost: Mapping[str, float] | None = None,
    time_budget: float | None = None,
) -> Problem:
    """Assemble a ``Problem`` from per-GEMM costs.

    Args:
        costs: ``costs[GemmId][format]`` >= 0 (e.g. normalized SNIP divergence). A
            candidate missing from a GEMM's mapping, or ``math.inf``, is not allowed there.
        linear_numel: K*N per linear (``model.shapes.linear_numel``); the FLOP weight of each GEMM.
        formats: candidate formats, e.g. ["fp8", "nvfp4"].
        fp4_target: rho in [0, 1].
        granularity: "gemm" - each GemmId is a unit; "layer" - the fprop/dgrad/wgrad of
            one (layer, linear) share one format and their costs are added.
        stage_of_layer: global layer index -> pipeline stage; None for no stages.
        per_stage: enforce the targets per stage (default: whenever stages are given).
        time_cost, time_budget: optional relative-time budget, see ``Problem``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} must be one of {GRANULARITIES}")
    if not costs:
        raise ValueError("costs is empty; there must be a cost mapping for at least one GemmId")
    formats = tuple(formats)
    check_formats(formats)
    missing = [lin for lin in LINEARS if lin not in linear_numel]
    if missing:
        raise ValueError(f"linear_numel lacks {missing}; pass K*N for each of {LINEARS} (model.shapes.linear_numel)")
    for lin in LINEARS:
        n = linear_numel[lin]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"linear_numel[{lin!r}]={n!r} must be a positive integer K*N")
    if stage_of_layer is not None:
        absent = sorted({g.layer for g in costs} - set(stage_of_layer))
        if absent:
            raise ValueError(f"stage_of_layer has no stage for layer(s) {absent[:8]}; map every layer to a stage")
    if per_stage is None:
        per_stage = stage_of_layer is not None

    def row(gids: Sequence[GemmId]) -> tuple[float, ...]:
        return tuple(sum(float(costs[g].get(f, math.inf)) for g in gids) for f in formats)

    groups: list[tuple[str, tuple[GemmId, ...]]]
    if granularity == "gemm":
        groups = [(g.key, (g,)) for g in sorted(costs, key=_canonical)]
    else:
        by_linear: dict[tuple[int, str], list[GemmId]] = {}
        for g in sorted(costs, key=_canonical):
            by_linear.setdefault((g.layer, g.linear), []).append(g)
        for (layer, lin), gids in by_linear.items():
            if len(gids) != len(GEMMS):
                raise ValueError(
                    f"granularity='layer' ties fprop/dgrad/wgrad of layer {layer} {lin}, but costs has only "
                    f"{[g.gemm for g in gids]}; give costs for all three GEMMs or use granularity='gemm'"
                )
        groups = [(f"{layer}.{lin}", tuple(gids)) for (layer, lin), gids in by_linear.items()]

    units = tuple(
        Unit(
            name=name,
            gemms=gids,
            flops=sum(linear_numel[g.linear] for g in gids),
            stage=None if stage_of_layer is None else int(stage_of_layer[gids[0].layer]),
        )
        for name, gids in groups
    )
    return Problem(
        units=units,
        formats=formats,
        cost=tuple(row(gids) for _, gids in groups),
        fp4_target=fp4_target,
        per_stage=per_stage,
        time_cost=time_cost,
        time_budget=time_budget,
        granularity=granularity,
    )


def _canonical(g: GemmId) -> tuple[int, int, int]:
    """Layer, then linear, then GEMM in model order (GemmId's own order is alphabetical)."""
    return (g.layer, LINEARS.index(g.linear), GEMMS.index(g.gemm))


# --------------------------------------------------------------------------------------
# Exact integer data shared by the CP-SAT model, the feasibility check and the tests' DP oracle
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Constraints:
    """Integer form of the constraints (see the module docstring for the rounding)."""

    weight: tuple[int, ...]  # w_u / gcd
    allowed: tuple[tuple[bool, ...], ...]  # [u][f]
    is_fp4: tuple[bool, ...]  # [f]
    fp4_rhs: int  # global: sum fp4 weight >= fp4_rhs
    stage_fp4_rhs: dict[int, int]  # per stage (empty unless per_stage)
    time_int: tuple[int, ...] | None  # [f] scaled time cost
    time_ref: int | None  # scaled bf16 time cost (the budget's reference)
    time_rhs: int | None  # global: sum w*t <= time_rhs
    stage_time_rhs: dict[int, int]


def _dec(x: float) -> Fraction:
    """The decimal number ``x`` prints as (0.9 -> 9/10), so targets mean what users typed."""
    return Fraction(repr(float(x)))


def time_ints(time_cost: Mapping[str, float], names: Iterable[str]) -> dict[str, int]:
    """The time costs of ``names`` as integers on one common scale (the lcm of their decimal
    denominators; a 1e-6 grid past that, see the module docstring). The exact form the ILP's
    time cap and the static policies' budget check both use."""
    fr = {f: _dec(time_cost[f]) for f in dict.fromkeys(names)}
    denom = reduce(math.lcm, (x.denominator for x in fr.values()))
    if denom > _TIME_GRID:  # documented approximation: round to a 1e-6 grid
        fr = {f: Fraction(round(x * _TIME_GRID), _TIME_GRID) for f, x in fr.items()}
        denom = _TIME_GRID
    return {f: int(x * denom) for f, x in fr.items()}


def time_cap(time_budget: float, t_bf16: int, weight: int) -> int:
    """Largest integer sum of w*t (``time_ints`` scale) within ``time_budget`` x the BF16 time of
    FLOP weight ``weight``: floor(B * t_bf16 * weight), B read as the decimal it prints as, so
    ``sum <= time_cap`` holds exactly in rational arithmetic."""
    return math.floor(_dec(time_budget) * t_bf16 * weight)


def _constraints(p: Problem) -> _Constraints:
    gcd = reduce(math.gcd, (u.flops for u in p.units))
    weight = tuple(u.flops // gcd for u in p.units)
    rho = _dec(p.fp4_target)

    def fp4_rhs(ws: Iterable[int]) -> int:
        return math.ceil(rho * sum(ws))

    stage_fp4 = (
        {s: fp4_rhs(w for w, u in zip(weight, p.units) if u.stage == s) for s in p.stages} if p.per_stage else {}
    )
    time_int = time_rhs = time_ref = None
    stage_time: dict[int, int] = {}
    if p.time_cost is not None:
        t = time_ints(p.time_cost, (*p.formats, "bf16"))
        time_int = tuple(max(t[f], 1) for f in p.formats)
        time_ref = t["bf16"]

        def cap(ws: Iterable[int]) -> int:
            return time_cap(p.time_budget, t["bf16"], sum(ws))

        time_rhs = cap(weight)
        if p.per_stage:
            stage_time = {s: cap(w for w, u in zip(weight, p.units) if u.stage == s) for s in p.stages}
    return _Constraints(
        weight=weight,
        allowed=tuple(tuple(c < math.inf for c in row) for row in p.cost),
        is_fp4=tuple(f in FP4_FORMATS for f in p.formats),
        fp4_rhs=fp4_rhs(weight),
        stage_fp4_rhs=stage_fp4,
        time_int=time_int,
        time_ref=time_ref,
        time_rhs=time_rhs,
        stage_time_rhs=stage_time,
    )


# --------------------------------------------------------------------------------------
# Feasibility
# --------------------------------------------------------------------------------------
def check_feasible(
    formats: Sequence[str],
    fp4_target: float,
    *,
    time_cost: Mapping[str, float] | None = None,
    time_budget: float | None = None,
) -> None:
    """Before any costs exist: can these candidates meet the targets at all?

    Assumes every candidate is allowed for every GEMM (divisibility is checked
    elsewhere) and ``fp4_target`` already validated (``PlanContext``, the config). Raises
    ``InfeasibleError`` (a ValueError) naming the constraint.
    """
    formats = tuple(formats)
    check_formats(formats)
    assert 0.0 <= fp4_target <= 1.0, f"fp4_target={fp4_target!r} (validated by PlanContext or the config)"
    fp4 = [f for f in formats if f in FP4_FORMATS]
    if fp4_target > 0 and not fp4:
        raise InfeasibleError(
            f"fp4_target={fp4_target} cannot be met: no FP4 format among the candidates {list(formats)}; "
            f"add one of {sorted(FP4_FORMATS)} to the candidates or set fp4_target=0"
        )
    if (time_cost is None) != (time_budget is None):
        raise ValueError("time_cost and time_budget go together; pass both (or neither)")
    if time_cost is None:
        return
    for f in (*formats, "bf16"):
        if not (0 < time_cost.get(f, -1.0) < math.inf):
            raise ValueError(f"time_cost[{f!r}]={time_cost.get(f)!r}; give a positive relative cost per FLOP for it")
    t_ref = time_cost["bf16"]
    fastest = min(time_cost[f] for f in formats) / t_ref
    # Best mix honoring the FP4 floor: rho of the FLOPs at the fastest FP4 format, the
    # rest at the fastest candidate (a relaxation - a necessary condition).
    mix = fastest if not fp4 else (fp4_target * min(time_cost[f] for f in fp4) / t_ref + (1 - fp4_target) * fastest)
    if mix > time_budget:
        raise InfeasibleError(
            f"time_budget={time_budget} cannot be met: with fp4_target={fp4_target} and candidates {list(formats)} "
            f"the fastest mix needs {mix:.4g} of BF16 time; raise time_budget or add faster formats"
        )


def check_problem(problem: Problem) -> None:
    """Necessary conditions on a full problem; raises ``InfeasibleError`` naming the constraint.

    Checks each constraint alone (a unit with no allowed format, the FP4 floor
    globally and per stage, the time cap globally and per stage). Targets that are
    each achievable but not together are reported by ``solve`` as INFEASIBLE.
    """
    p, c = problem, _constraints(problem)
    for unit, ok in zip(p.units, c.allowed):
        if not any(ok):
            raise InfeasibleError(f"unit {unit.name} has no allowed format among {list(p.formats)} (all costs inf)")
    fp4_names = [f for f, is4 in zip(p.formats, c.is_fp4) if is4]
    can_fp4 = [any(a and is4 for a, is4 in zip(ok, c.is_fp4)) for ok in c.allowed]

    def fp4_check(idx: list[int], rhs: int, where: str) -> None:
        best = sum(c.weight[i] for i in idx if can_fp4[i])
        if best < rhs:
            total = sum(c.weight[i] for i in idx)
            if not fp4_names:
                raise InfeasibleError(
                    f"fp4_target={p.fp4_target} cannot be met: no FP4 format among the candidates "
                    f"{list(p.formats)}; add one of {sorted(FP4_FORMATS)} or set fp4_target=0"
                )
            raise InfeasibleError(
                f"fp4_target={p.fp4_target} cannot be met: the FP4 candidates {fp4_names} cover at most "
                f"{best / total:.4%} of the linear FLOPs{where}; lower fp4_target or allow FP4 on more GEMMs"
            )

    def time_check(idx: list[int], rhs: int, where: str) -> None:
        assert c.time_int is not None
        need = sum(c.weight[i] * min(t for t, a in zip(c.time_int, c.allowed[i]) if a) for i in idx)
        if need > rhs:
            ref = sum(c.weight[i] for i in idx) * c.time_ref
            raise InfeasibleError(
                f"time_budget={p.time_budget} cannot be met{where}: even the fastest allowed formats need "
                f"{need / ref:.4g} of BF16 time; raise time_budget or add faster candidates"
            )

    everything = list(range(len(p.units)))
    fp4_check(everything, c.fp4_rhs, "")
    for s, rhs in c.stage_fp4_rhs.items():
        fp4_check([i for i, u in enumerate(p.units) if u.stage == s], rhs, f" on stage {s}")
    if c.time_rhs is not None:
        time_check(everything, c.time_rhs, "")
        for s, rhs in c.stage_time_rhs.items():
            time_check([i for i, u in enumerate(p.units) if u.stage == s], rhs, f" on stage {s}")


__all__ = [
    "GRANULARITIES",
    "InfeasibleError",
    "Problem",
    "Unit",
    "build_problem",
    "check_feasible",
    "check_formats",
    "check_problem",
    "check_share",
    "time_cap",
    "time_ints",
]
