"""Precision policies: SNIP and the baselines it is compared against, behind one interface.

Every policy turns a spec string plus a ``PlanContext`` into a ``PrecisionPlan`` at
the same FP4 FLOP-share target rho (``ctx.fp4_target``), so runs differ only in
*which* GEMMs go to FP4:

==================  =====================================================================
spec                plan
==================  =====================================================================
``bf16``            every GEMM in BF16 (reference; exempt from rho)
``uniform:<fmt>``   every GEMM in ``fmt`` (``uniform:fp8`` is exempt from rho; an FP4
                    format trivially meets it)
``bf16_ends:a,b``   NVIDIA's NVFP4 recipe: the first ``a`` and last ``b`` blocks in the
                    high-precision candidate, all other blocks FP4. Explicit counts are a
                    fixed recipe and are honoured even if they miss rho (the plan's
                    ``fp4_flops_share`` says what they achieve). Without ``:a,b``: the
                    largest symmetric ends whose FP4 share is still >= rho.
``layer_type[:l,..]`` keep the listed linear types (default ``fc2,proj``) in high precision,
                    everything else FP4; if that misses rho, protected linears move to FP4
                    (one decision unit at a time, from the middle blocks outward, the
                    last-listed type first within a block) until rho is met. If it
                    overshoots rho, it stays there - the point is the layer-type rule.
``random``          seeded random order of the decision units, FP4 until rho is met
                    (per stage when stages are given), the rest high precision

With ``fair_share`` (``snip.fair_share``) the static rules become orders of protection instead:
every unit starts in FP4 and, in the rule's order, each one moves to the high-precision candidate
if the FP4 share of its pipeline stage stays >= rho. So each lands within one decision unit above
rho, like the ILP policies, and a comparison runs every policy at the same share:

  * ``bf16_ends`` (no counts): blocks from the ends inward (0, L-1, 1, L-2, ...), unit by unit;
  * ``layer_type``: the protected types first (ends inward, first-listed type first), then the
    others, ends inward - so a rule that overshoots rho protects more, one that misses it less;
  * ``random``: a seeded random order.
``min_rel_err``     the SNIP ILP with cost = measured relative quantization error of each
                    GEMM's output (the paper's local-error baseline); needs ``costs``
``snip``            the SNIP ILP with the SNIP costs passed in; needs ``costs``
==================  =====================================================================

The *high-precision candidate* is the non-FP4 format among ``ctx.formats`` (if several,
``bf16`` when listed, else the first listed; ``bf16`` when there is none). The *FP4
candidate* for static policies is the first FP4 format listed in ``ctx.formats``.
Static policies target the global share; only the ILP policies and ``random`` also
honour it per pipeline stage.

Each policy is one entry of ``POLICIES`` (name -> how its spec parses, which statistics its
costs need, how it makes a plan); ``PlanContext.for_run`` builds the context of a run from its
config and pipeline layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from megatron_snip.config import SnipConfig
from megatron_snip.parallel.topology import stage_of_layer
from megatron_snip.precision.formats import FORMATS, FP4_FORMATS
from megatron_snip.precision.plan import GEMMS, LINEARS, GemmId, PrecisionPlan, all_gemm_ids
from megatron_snip.snip import ilp
from megatron_snip.snip.metrics import relative_error_costs, snip_costs

DEFAULT_PROTECTED = ("fc2", "proj")
_EXEMPT = "exempt from fp4_target (a reference, not an efficiency policy)"

Costs = Mapping[GemmId, Mapping[str, float]]
Statistics = Literal["errors", "all"]


class SolveTimeoutError(RuntimeError):
    """The ILP found no solution in its time limit and there was no previous plan to keep."""


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy spec: ``name`` plus its arguments (``format``, ``ends`` or ``protected``)."""

    spec: str
    name: str
    format: str | None = None
    ends: tuple[int, int] | None = None
    protected: tuple[str, ...] = ()

    @property
    def policy(self) -> Policy:
        return POLICIES[self.name]


@dataclass(frozen=True)
class Policy:
    """One policy in the registry (``POLICIES``).

    Attributes:
        name: the spec's name part (before any ``:``).
        forms: the spec forms it accepts, for messages.
        parse: (spec as given, spec stripped, argument after ``:`` or None) -> ``PolicySpec``;
            ValueError naming the forms otherwise.
        make: (spec, context, costs, previous plan) -> ``PrecisionPlan`` (see ``make_plan``).
        statistics: which probe passes its costs need: None (a static policy, no statistics),
            ``"errors"`` (pass 1 only: measured GEMM errors) or ``"all"`` (also the noise passes:
            curvature and propagation gains). See ``snip/stats.py``.
        costs: (whole-model snapshot, weight_divergence_weight) -> the costs it minimizes
            (``snip/metrics.py``); None for a static policy.
    """

    name: str
    forms: tuple[str, ...]
    parse: Callable[[str, str, str | None], PolicySpec]
    make: Callable[[PolicySpec, PlanContext, Costs | None, PrecisionPlan | None], PrecisionPlan]
    statistics: Statistics | None = None
    costs: Callable[[Mapping[str, Any], float], dict[GemmId, dict[str, float]]] | None = None

    @property
    def needs_costs(self) -> bool:
        return self.costs is not None


def parse_policy(spec: str) -> PolicySpec:
    """Parse and validate a policy spec (for config validation); ValueError listing the forms otherwise."""
    if not isinstance(spec, str):
        raise ValueError(f"policy spec {spec!r} must be a string, one of {POLICY_FORMS}")
    text = spec.strip()
    name, sep, arg = text.partition(":")
    if sep and not arg:
        raise ValueError(f"policy spec {spec!r} has an empty argument after ':'; forms: {POLICY_FORMS}")
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown policy {spec!r}; choose one of {POLICY_FORMS}")
    return policy.parse(spec, text, arg if sep else None)


def needs_costs(spec: str) -> bool:
    """True for the ILP policies (``snip``, ``min_rel_err``) that need a costs mapping."""
    return parse_policy(spec).policy.needs_costs


def policy_costs(spec: str, snapshot: Mapping[str, Any],
                 weight_divergence_weight: float = 1.0) -> dict[GemmId, dict[str, float]]:
    """The costs an ILP policy minimizes, from a whole-model statistics snapshot: SNIP's divergences
    for ``"snip"``, the relative GEMM errors for ``"min_rel_err"`` (the controller and the offline
    planner both use this). ValueError for a policy that takes no costs."""
    policy = parse_policy(spec).policy
    if policy.costs is None:
        takers = " and ".join(repr(p.name) for p in POLICIES.values() if p.costs is not None)
        raise ValueError(f"policy {spec!r} takes no costs; the cost-based policies are {takers}")
    return policy.costs(snapshot, weight_divergence_weight)


def _parse_plain(spec: str, text: str, arg: str | None) -> PolicySpec:
    name = text.partition(":")[0]
    if arg is not None:
        raise ValueError(f"policy {name!r} takes no arguments (got {spec!r}); write just {name!r}")
    return PolicySpec(text, name)


def _parse_uniform(spec: str, text: str, arg: str | None) -> PolicySpec:
    if arg not in FORMATS:
        raise ValueError(f"policy spec {spec!r}: format {arg or ''!r} is unknown; "
                         f"write uniform:<one of {sorted(FORMATS)}>")
    return PolicySpec(text, "uniform", format=arg)


def _parse_bf16_ends(spec: str, text: str, arg: str | None) -> PolicySpec:
    if arg is None:
        return PolicySpec(text, "bf16_ends")
    parts = arg.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"policy spec {spec!r}: expected bf16_ends:<first>,<last> with two non-negative integers, "
            "e.g. bf16_ends:2,8, or plain bf16_ends to choose symmetric ends from fp4_target"
        )
    return PolicySpec(text, "bf16_ends", ends=(int(parts[0]), int(parts[1])))


def _parse_layer_type(spec: str, text: str, arg: str | None) -> PolicySpec:
    if arg is None:
        return PolicySpec(text, "layer_type", protected=DEFAULT_PROTECTED)
    lins = tuple(p.strip() for p in arg.split(","))
    bad = [lin for lin in lins if lin not in LINEARS]
    if bad or len(set(lins)) != len(lins):
        raise ValueError(
            f"policy spec {spec!r}: linear types must be distinct names from {LINEARS} "
            f"(bad: {bad or 'duplicates'}), e.g. layer_type:fc2,proj"
        )
    return PolicySpec(text, "layer_type", protected=lins)


@dataclass(frozen=True)
class PlanContext:
    """Everything a policy needs besides costs.

    Attributes:
        num_layers: number of transformer blocks (global).
        linear_numel: K*N per linear (``model.shapes.linear_numel``): each GEMM's FLOP weight.
        formats: candidate formats, e.g. ("fp8", "nvfp4").
        fp4_target: rho in [0, 1], validated here (the boundary of the policies and the ILP;
            past it, ``ilp`` only asserts it).
        granularity: "gemm" or "layer" (decision unit of ILP, ``random`` and ``layer_type``).
        stage_of_layer: layer -> pipeline stage, or None (single stage / no per-stage target).
        seed: seed of ``random`` and of CP-SAT.
        step: training step the plan is made at.
        max_deterministic_time, num_workers: CP-SAT settings (see ``ilp.solve``).
        time_cost, time_budget: optional relative-time budget for the ILP (see ``ilp.Problem``).
        fair_share: static policies protect units in their rule's order down to rho (module docstring).
    """

    num_layers: int
    linear_numel: Mapping[str, int]
    formats: tuple[str, ...]
    fp4_target: float
    granularity: str = "gemm"
    stage_of_layer: Mapping[int, int] | None = None
    seed: int = 0
    step: int = 0
    max_deterministic_time: float = 10.0
    num_workers: int = 1
    time_cost: Mapping[str, float] | None = None
    time_budget: float | None = None
    fair_share: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"PlanContext.num_layers={self.num_layers!r} must be a positive integer")
        object.__setattr__(self, "formats", tuple(self.formats))
        ilp.check_formats(self.formats)
        ilp.check_share("fp4_target", self.fp4_target)
        if self.granularity not in ilp.GRANULARITIES:
            raise ValueError(f"PlanContext.granularity={self.granularity!r} must be one of {ilp.GRANULARITIES}")
        missing = [lin for lin in LINEARS if lin not in self.linear_numel]
        if missing:
            raise ValueError(f"PlanContext.linear_numel lacks {missing}; use model.shapes.linear_numel(shapes)")
        object.__setattr__(self, "linear_numel", MappingProxyType(dict(self.linear_numel)))
        if self.stage_of_layer is not None:
            absent = [layer for layer in range(self.num_layers) if layer not in self.stage_of_layer]
            if absent:
                raise ValueError(f"PlanContext.stage_of_layer has no stage for layer(s) {absent[:8]}")
            object.__setattr__(self, "stage_of_layer", MappingProxyType(dict(self.stage_of_layer)))

    @classmethod
    def for_run(cls, snip: SnipConfig, num_layers: int, linear_numel: Mapping[str, int], pp: int, *,
                step: int = 0, **snip_overrides: Any) -> PlanContext:
        """The plan context of a run, the one place config and topology become a ``PlanContext``.

        Candidates, FP4 target, granularity, seed and CP-SAT time come from ``snip`` (with any
        ``snip_overrides`` of its fields, validated as the config is), the per-stage split of the
        ``num_layers`` blocks over ``pp`` pipeline stages from ``parallel.topology.stage_of_layer``.
        ``linear_numel``: K*N per linear (``model.shapes.linear_numel``).
        """
        if snip_overrides:
            snip = replace(snip, **snip_overrides)
        return cls(num_layers=num_layers, linear_numel=linear_numel, formats=tuple(snip.formats),
                   fp4_target=snip.fp4_target, granularity=snip.granularity,
                   stage_of_layer=stage_of_layer(num_layers, pp), seed=snip.seed, step=step,
                   max_deterministic_time=snip.solver_max_time, fair_share=snip.fair_share)

    def at_step(self, step: int) -> PlanContext:
        """This context for a plan made at ``step``."""
        return replace(self, step=step)

    @property
    def high_format(self) -> str:
        """The high-precision candidate (see module docstring)."""
        high = [f for f in self.formats if f not in FP4_FORMATS]
        if not high:
            return "bf16"
        return "bf16" if "bf16" in high else high[0]

    @property
    def fp4_format(self) -> str:
        """The FP4 candidate of the static policies: the first FP4 format in ``formats``."""
        for f in self.formats:
            if f in FP4_FORMATS:
                return f
        raise ilp.InfeasibleError(
            f"this policy puts GEMMs in FP4 but no FP4 format is among formats={list(self.formats)}; "
            f"add one of {sorted(FP4_FORMATS)}"
        )


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------
def make_plan(
    spec: str,
    ctx: PlanContext,
    costs: Mapping[GemmId, Mapping[str, float]] | None = None,
    previous: PrecisionPlan | None = None,
) -> PrecisionPlan:
    """Make the plan of policy ``spec`` for ``ctx``.

    Args:
        spec: a policy spec (``parse_policy``).
        ctx: model and target description.
        costs: ``costs[GemmId][format]`` for every GemmId of the model; required by
            ``snip`` and ``min_rel_err``, ignored by the static policies.
        previous: the plan in force; ILP policies use it as a warm start and, if the
            solver times out without a solution, return it unchanged (same entries,
            step, policy and hash) with ``solver_status="TIMEOUT"``.

    Returns:
        ``PrecisionPlan`` with ``policy=spec``, ``step=ctx.step`` and ``extra["fp4_target"]``;
        ILP plans also carry ``objective``, ``solver_status`` and solver timings in ``extra``.

    Raises:
        ValueError: bad spec or missing/incomplete costs.
        ilp.InfeasibleError: rho cannot be met (message names the constraint).
        SolveTimeoutError: the ILP found nothing in time and ``previous`` is None.
    """
    ps = parse_policy(spec)
    return ps.policy.make(ps, ctx, costs, previous)


# --------------------------------------------------------------------------------------
# Static policies
# --------------------------------------------------------------------------------------
def _uniform(ctx: PlanContext, fmt: str) -> dict[GemmId, str]:
    return {g: fmt for g in all_gemm_ids(ctx.num_layers)}


def _by_layer(ctx: PlanContext, high_layers: set[int]) -> dict[GemmId, str]:
    hi, lo = ctx.high_format, ctx.fp4_format
    return {g: hi if g.layer in high_layers else lo for g in all_gemm_ids(ctx.num_layers)}


def _bf16_ends(ctx: PlanContext, ends: tuple[int, int] | None) -> tuple[dict[GemmId, str], tuple[int, int]]:
    num_layers = ctx.num_layers
    if ends is not None:
        first, last = ends
        if first + last > num_layers:
            raise ValueError(
                f"policy bf16_ends:{first},{last} keeps {first + last} blocks in high precision but the model has "
                f"only num_layers={num_layers}; choose first + last <= {num_layers}"
            )
    elif ctx.fair_share:
        rank = {layer: i for i, layer in enumerate(_ends_inward(num_layers))}
        entries = _protect_down_to_target(ctx, sorted(_units(ctx), key=lambda u: rank[u[0].layer]))
        whole = [layer for layer in range(num_layers)
                 if all(f == ctx.high_format for g, f in entries.items() if g.layer == layer)]
        first = next((i for i in range(num_layers) if i not in whole), num_layers)
        last = next((i for i in range(num_layers) if num_layers - 1 - i not in whole), num_layers)
        return entries, (first, last)  # the blocks fully protected at each end
    else:
        # Every block has the same FLOPs, so the share falls as the ends grow: take the
        # largest symmetric e whose share is still >= rho (closest from above).
        first = last = 0
        for e in range(1, (num_layers + 1) // 2 + 1):
            trial = _by_layer(ctx, _ends(num_layers, e, e))
            if _meets(trial, ctx.linear_numel, ctx.fp4_target):
                first = last = e
            else:
                break
    return _by_layer(ctx, _ends(num_layers, first, last)), (first, last)


def _protect_down_to_target(ctx: PlanContext, order: list[tuple[GemmId, ...]]) -> dict[GemmId, str]:
    """``fair_share``: all units FP4, then each unit of ``order`` (every unit, once) moves to the
    high-precision candidate if its stage's FP4 share stays >= rho. A unit left in FP4 could not
    move, so each stage's share is below rho + the weight of its lightest FP4 unit."""
    hi, lo = ctx.high_format, ctx.fp4_format
    numel = ctx.linear_numel
    entries = {g: lo for u in order for g in u}
    stage_of = ctx.stage_of_layer or {}
    fp4: dict[int, int] = {}
    need: dict[int, int] = {}
    for stage in {stage_of.get(u[0].layer, 0) for u in order}:
        members = {g: lo for u in order if stage_of.get(u[0].layer, 0) == stage for g in u}
        fp4[stage], need[stage] = sum(numel[g.linear] for g in members), _need(members, numel, ctx.fp4_target)
    for unit in order:
        stage, weight = stage_of.get(unit[0].layer, 0), sum(numel[g.linear] for g in unit)
        if fp4[stage] - weight >= need[stage]:
            fp4[stage] -= weight
            for g in unit:
                entries[g] = hi
    return entries


def _ends_inward(num_layers: int) -> list[int]:
    """Blocks from the ends inward: 0, L-1, 1, L-2, ..."""
    return [layer for i in range((num_layers + 1) // 2) for layer in dict.fromkeys((i, num_layers - 1 - i))]


def _ends(num_layers: int, first: int, last: int) -> set[int]:
    return set(range(min(first, num_layers))) | set(range(max(0, num_layers - last), num_layers))


def _units(ctx: PlanContext) -> list[tuple[GemmId, ...]]:
    """Decision units at ``ctx.granularity``, canonical order."""
    gids = all_gemm_ids(ctx.num_layers)
    if ctx.granularity == "gemm":
        return [(g,) for g in gids]
    return [tuple(gids[i : i + len(GEMMS)]) for i in range(0, len(gids), len(GEMMS))]


def _layer_type(ctx: PlanContext, protected: tuple[str, ...]) -> dict[GemmId, str]:
    if ctx.fair_share:
        block = {layer: i for i, layer in enumerate(_ends_inward(ctx.num_layers))}
        kind = {lin: i for i, lin in enumerate(protected + tuple(lin for lin in LINEARS if lin not in protected))}
        order = sorted(_units(ctx), key=lambda u: (u[0].linear not in protected, block[u[0].layer], kind[u[0].linear]))
        return _protect_down_to_target(ctx, order)
    hi, lo = ctx.high_format, ctx.fp4_format
    entries = {g: hi if g.linear in protected else lo for g in all_gemm_ids(ctx.num_layers)}
    if _meets(entries, ctx.linear_numel, ctx.fp4_target):
        return entries
    # Move protected units to FP4 from the middle blocks outward; within a block the
    # last-listed (least protected) linear type goes first.
    mid = (ctx.num_layers - 1) / 2
    rank = {lin: i for i, lin in enumerate(reversed(protected))}
    movable = [u for u in _units(ctx) if u[0].linear in protected]
    movable.sort(key=lambda u: (abs(u[0].layer - mid), u[0].layer, rank[u[0].linear]))
    already = sum(ctx.linear_numel[g.linear] for g, f in entries.items() if f == lo)
    k = _prefix_to_meet(movable, ctx.linear_numel, _need(entries, ctx.linear_numel, ctx.fp4_target) - already)
    for unit in movable[:k]:
        for g in unit:
            entries[g] = lo
    return entries


def _random(ctx: PlanContext) -> dict[GemmId, str]:
    hi, lo = ctx.high_format, ctx.fp4_format
    rng = np.random.default_rng(ctx.seed)
    units = _units(ctx)
    if ctx.fair_share:
        return _protect_down_to_target(ctx, [units[i] for i in rng.permutation(len(units))])
    entries = {g: hi for u in units for g in u}
    stage_of = ctx.stage_of_layer or {}
    groups: dict[int, list[tuple[GemmId, ...]]] = {}
    for u in units:
        groups.setdefault(stage_of.get(u[0].layer, 0), []).append(u)
    # One permutation of all units, then each stage fills FP4 in that order until its
    # own share reaches rho (so the global share does too).
    order = {u: r for r, u in enumerate(units[i] for i in rng.permutation(len(units)))}
    for members in groups.values():
        members = sorted(members, key=order.__getitem__)
        group_entries = {g: hi for u in members for g in u}
        k = _prefix_to_meet(members, ctx.linear_numel, _need(group_entries, ctx.linear_numel, ctx.fp4_target))
        for unit in members[:k]:
            for g in unit:
                entries[g] = lo
    return entries


def _need(entries: Mapping[GemmId, str], numel: Mapping[str, int], rho: float) -> int:
    """Smallest integer FP4 weight (sum of K*N) meeting rho over ``entries``' GEMMs, exact."""
    total = sum(numel[g.linear] for g in entries)
    return math.ceil(Fraction(repr(float(rho))) * total)  # rho as typed (0.9 = 9/10), exact


def _meets(entries: Mapping[GemmId, str], numel: Mapping[str, int], rho: float) -> bool:
    fp4 = sum(numel[g.linear] for g, f in entries.items() if f in FP4_FORMATS)
    return fp4 >= _need(entries, numel, rho)


def _prefix_to_meet(units: list[tuple[GemmId, ...]], numel: Mapping[str, int], need: int) -> int:
    """Length of the shortest prefix of ``units`` whose FLOP weight reaches ``need`` (all if never)."""
    if need <= 0:
        return 0
    cum = np.cumsum([sum(numel[g.linear] for g in u) for u in units], dtype=np.int64)
    return min(int(np.searchsorted(cum, need)) + 1, len(units))


def _static_plan(ps: PolicySpec, ctx: PlanContext, entries: Mapping[GemmId, str], **extra: Any) -> PrecisionPlan:
    return PrecisionPlan.create(entries, ctx.linear_numel, step=ctx.step, policy=ps.spec,
                                extra={"fp4_target": ctx.fp4_target, **extra})


def _make_bf16(ps: PolicySpec, ctx: PlanContext, costs: Costs | None, previous: PrecisionPlan | None) -> PrecisionPlan:
    return _static_plan(ps, ctx, _uniform(ctx, "bf16"), note=_EXEMPT)


def _make_uniform(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                  previous: PrecisionPlan | None) -> PrecisionPlan:
    assert ps.format is not None
    return _static_plan(ps, ctx, _uniform(ctx, ps.format), **({} if ps.format in FP4_FORMATS else {"note": _EXEMPT}))


def _make_bf16_ends(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                    previous: PrecisionPlan | None) -> PrecisionPlan:
    ilp.check_feasible(ctx.formats, ctx.fp4_target)  # static policies ignore the time budget
    entries, (first, last) = _bf16_ends(ctx, ps.ends)
    return _static_plan(ps, ctx, entries, ends_first=first, ends_last=last)


def _make_layer_type(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                     previous: PrecisionPlan | None) -> PrecisionPlan:
    ilp.check_feasible(ctx.formats, ctx.fp4_target)
    return _static_plan(ps, ctx, _layer_type(ctx, ps.protected))


def _make_random(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                 previous: PrecisionPlan | None) -> PrecisionPlan:
    ilp.check_feasible(ctx.formats, ctx.fp4_target)
    return _static_plan(ps, ctx, _random(ctx), seed=ctx.seed)


# --------------------------------------------------------------------------------------
# ILP policies
# --------------------------------------------------------------------------------------
def _ilp_plan(
    ps: PolicySpec,
    ctx: PlanContext,
    costs: Mapping[GemmId, Mapping[str, float]] | None,
    previous: PrecisionPlan | None,
) -> PrecisionPlan:
    ilp.check_feasible(ctx.formats, ctx.fp4_target, time_cost=ctx.time_cost, time_budget=ctx.time_budget)
    if costs is None:
        raise ValueError(f"policy {ps.spec!r} needs costs (per-GEMM, per-format); got costs=None")
    expected = set(all_gemm_ids(ctx.num_layers))
    missing, unknown = sorted(expected - set(costs)), sorted(set(costs) - expected)
    if missing or unknown:
        raise ValueError(
            f"policy {ps.spec!r}: costs must cover exactly the model's {len(expected)} GEMMs; "
            f"missing {[g.key for g in missing[:4]]}, unknown {[g.key for g in unknown[:4]]}"
        )
    problem = ilp.build_problem(
        costs,
        ctx.linear_numel,
        ctx.formats,
        ctx.fp4_target,
        ctx.granularity,
        ctx.stage_of_layer,
        time_cost=ctx.time_cost,
        time_budget=ctx.time_budget,
    )
    sol = ilp.solve(
        problem,
        warm_start=None if previous is None else previous.as_dict(),
        max_deterministic_time=ctx.max_deterministic_time,
        num_workers=ctx.num_workers,
        seed=ctx.seed,
    )
    if sol.status == "INFEASIBLE":
        raise ilp.InfeasibleError(sol.message)
    if not sol.ok:
        if previous is None:
            raise SolveTimeoutError(f"policy {ps.spec!r} at step {ctx.step}: {sol.message}; no previous plan to keep")
        note = (("solver_message", f"step {ctx.step}: {sol.message}; kept the plan from step {previous.step}"),)
        return replace(previous, solver_status=sol.status, extra=tuple(sorted(dict(previous.extra + note).items())))
    extra: dict[str, Any] = {
        "fp4_target": ctx.fp4_target,
        "granularity": ctx.granularity,
        "solve_time_s": sol.solve_time_s,
        "deterministic_time": sol.deterministic_time,
        "solver_bound": sol.bound,
    }
    if sol.per_stage_share:
        extra["min_stage_fp4_share"] = min(sol.per_stage_share.values())
    if sol.message:
        extra["solver_message"] = sol.message
    return PrecisionPlan.create(
        sol.assignment,
        ctx.linear_numel,
        step=ctx.step,
        policy=ps.spec,
        objective=sol.objective,
        solver_status=sol.status,
        extra=extra,
    )


# The registry: one entry per policy, in the order the spec forms are listed.
POLICIES: Mapping[str, Policy] = MappingProxyType({p.name: p for p in (
    Policy("bf16", ("bf16",), _parse_plain, _make_bf16),
    Policy("uniform", ("uniform:<format>",), _parse_uniform, _make_uniform),
    Policy("bf16_ends", ("bf16_ends", "bf16_ends:<first>,<last>"), _parse_bf16_ends, _make_bf16_ends),
    Policy("layer_type", ("layer_type", "layer_type:<linear>[,<linear>...]"), _parse_layer_type, _make_layer_type),
    Policy("random", ("random",), _parse_plain, _make_random),
    Policy("min_rel_err", ("min_rel_err",), _parse_plain, _ilp_plan, statistics="errors",
           costs=lambda snapshot, weight_divergence_weight: relative_error_costs(snapshot)),
    Policy("snip", ("snip",), _parse_plain, _ilp_plan, statistics="all", costs=snip_costs),
)})
POLICY_FORMS: tuple[str, ...] = tuple(form for p in POLICIES.values() for form in p.forms)


__all__ = [
    "DEFAULT_PROTECTED",
    "POLICIES",
    "POLICY_FORMS",
    "PlanContext",
    "Policy",
    "PolicySpec",
    "SolveTimeoutError",
    "make_plan",
    "needs_costs",
    "parse_policy",
    "policy_costs",
]
