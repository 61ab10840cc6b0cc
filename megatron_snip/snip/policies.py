"""Precision policies: SNIP and the baselines it is compared against, behind one interface.

Every policy turns a spec string plus a ``PlanContext`` into a ``PrecisionPlan`` at
the same target - the FP4 FLOP share rho (``ctx.fp4_target``) and/or a GEMM-time budget
(``ctx.time_budget``, see ``snip/context.py``) - so runs differ only in *which* GEMMs go to
the fast format. Below, "FP4" and "rho" read "the fast candidate" and "the targets" under a time
budget (e.g. candidates ``["bf16", "fp8"]``: FP8 is the fast one):

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
``tail``, ``tail:n``  NVIDIA's NVFP4 recipe (arXiv 2509.25149 App. E: the last blocks in BF16
                    converge, the first ones do not): the last ``n`` blocks in the high-precision
                    candidate (explicit counts honoured even if they miss rho); without ``:n``,
                    the largest number of last blocks whose FP4 share is still >= rho
``attn_protected``  Nemotron 3 Super's rule: attention's qkv and proj in the high-precision
                    candidate, FP4 elsewhere (``layer_type:qkv,proj``: filled to rho the same way)
``mlp_only``        MaxText's / Transformer Engine's NVFP4 recipe: FP4 only in fc1/fc2; where the
                    MLP alone misses rho, attention GEMMs are topped up into FP4, fprop before
                    dgrad before wgrad, from the middle blocks outward (``snip/rules.py``)
``layer_type[:l,..]`` keep the listed linear types (default ``fc2,proj``) in high precision,
                    everything else FP4; if that misses rho, protected linears move to FP4
                    (one decision unit at a time, from the middle blocks outward, the
                    last-listed type first within a block) until rho is met. If it
                    overshoots rho, it stays there - the point is the layer-type rule.
``random``          seeded random order of the decision units, FP4 until rho is met
                    (per stage when stages are given), the rest high precision
``<rule>+switch``   a rule with NVIDIA's switch (arXiv 2509.25149 App. D) for a run-level
                    budget (``snip.budget = "run"``, ``snip/budget.py``): at an interval share at or
                    above the run target rho, the rule itself at that share; below it, the rule's plan
                    at rho with its FP4 GEMMs promoted, fprop first, then dgrad, then wgrad, each
                    from the last block backwards (``rules.switch_entries``), e.g. ``tail+switch``.
                    The rule is a static one or an ILP policy (``snip+switch``: SNIP's plan in
                    space, NVIDIA's switch in time; two candidates only). The allocation over time
                    is a static rule's (a linear cost curve, see ``cost_curve``) either way.
                    Under the plan budget it is the rule (the share is rho)

With ``fair_share`` (``snip.fair_share``) the static rules become orders of protection instead:
every unit starts in FP4 and, in the rule's order, each one moves to the high-precision candidate
if the FP4 share of its pipeline stage stays >= rho. So each lands within one decision unit above
rho, like the ILP policies, and a comparison runs every policy at the same share:

  * ``bf16_ends`` (no counts): blocks from the ends inward (0, L-1, 1, L-2, ...), unit by unit;
  * ``layer_type``: the protected types first (ends inward, first-listed type first), then the
    others, ends inward - so a rule that overshoots rho protects more, one that misses it less;
  * ``tail`` (no count): units from the last block backwards;
  * ``attn_protected``: as ``layer_type:qkv,proj``;
  * ``mlp_only``: attention units from the ends inward (wgrad, dgrad, fprop), then the MLP's;
  * ``random``: a seeded random order.
``min_rel_err``     the SNIP ILP with cost = measured relative quantization error of each
                    GEMM's output (the paper's local-error baseline); needs ``costs``
``snip``            the SNIP ILP with the SNIP costs passed in; needs ``costs``
``truth``           the SNIP ILP with *measured* divergences as costs (``snip/truth.py``:
                    every linear's loss and update change in every format, by brute force
                    on ``snip.truth_batches`` training micro-batches): the plan SNIP's
                    metric would choose if it were exact. A research oracle, one process only
==================  =====================================================================

The *high-precision candidate* is the non-FP4 format among ``ctx.candidates`` (if several,
``bf16`` when listed, else the first listed; ``bf16`` when there is none). The *FP4
candidate* for static policies is the first FP4 format listed in ``ctx.candidates`` (without one,
under a time budget, the fastest other candidate). The static rules live in ``snip/rules.py``.
Under a time budget every plan records ``gemm_time_ratio``; ``uniform`` and ``bf16`` report it
and are not held to the budget.
Static policies target the global share; only the ILP policies and ``random`` also
honour it per pipeline stage.

Each policy is one entry of ``POLICIES`` (name -> how its spec parses, which statistics its
costs need, how it makes a plan); ``PlanContext.for_run`` builds the context of a run from its
config and pipeline layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Literal

from megatron_snip.precision.formats import FORMATS, FP4_FORMATS
from megatron_snip.precision.plan import LINEARS, GemmId, PrecisionPlan, all_gemm_ids
from megatron_snip.snip import ilp
from megatron_snip.snip.context import PlanContext
from megatron_snip.snip.metrics import relative_error_costs, snip_costs, truth_costs
from megatron_snip.snip.rules import (
    ATTENTION,
    DEFAULT_PROTECTED,
    Targets,
    bf16_ends_entries,
    layer_type_entries,
    mlp_only_entries,
    random_entries,
    switch_entries,
    tail_entries,
    uniform_entries,
)

_EXEMPT = "exempt from fp4_target (a reference, not an efficiency policy)"

Costs = Mapping[GemmId, Mapping[str, float]]
Statistics = Literal["errors", "all", "truth"]


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
    switch: bool = False  # ``<rule>+switch`` (see the module docstring)

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
            curvature and propagation gains). See ``snip/stats.py``. ``"truth"``: the measured
            divergences of ``snip/truth.py`` instead.
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
        # ValueError, not TypeError: a wrong type here is bad user input, which the house reports as ValueError
        raise ValueError(f"policy spec {spec!r} must be a string, one of {POLICY_FORMS}")  # noqa: TRY004
    text = spec.strip()
    if text.endswith(SWITCH):
        rule = text[: -len(SWITCH)]
        base = parse_policy(rule) if rule else None
        if base is None or base.name not in SWITCHABLE:
            raise ValueError(f"policy spec {spec!r}: '{SWITCH}' follows a static rule or an ILP policy, one of "
                             f"{[f'{name}{SWITCH}' for name in SWITCHABLE]} (with its arguments, e.g. tail:4{SWITCH})")
        return replace(base, spec=text, switch=True)
    name, sep, arg = text.partition(":")
    if sep and not arg:
        raise ValueError(f"policy spec {spec!r} has an empty argument after ':'; forms: {POLICY_FORMS}")
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown policy {spec!r}; choose one of {POLICY_FORMS} (a rule may add {SWITCH!r})")
    return policy.parse(spec, text, arg if sep else None)


def needs_costs(spec: str) -> bool:
    """True for the ILP policies (``snip``, ``min_rel_err``, ``truth``) that need a costs mapping."""
    return parse_policy(spec).policy.needs_costs


def policy_costs(spec: str, snapshot: Mapping[str, Any],
                 weight_divergence_weight: float = 1.0) -> dict[GemmId, dict[str, float]]:
    """The costs an ILP policy minimizes, from a whole-model statistics snapshot: SNIP's divergences
    for ``"snip"``, the relative GEMM errors for ``"min_rel_err"``, the measured divergences for
    ``"truth"`` (the controller and the offline planner both use this). ValueError for a policy that
    takes no costs."""
    policy = parse_policy(spec).policy
    if policy.costs is None:
        takers = " and ".join(repr(p.name) for p in POLICIES.values() if p.costs is not None)
        raise ValueError(f"policy {spec!r} takes no costs; the cost-based policies are {takers}")
    costs = policy.costs(snapshot, weight_divergence_weight)
    # BF16 is the zero-error reference (its measured "error" is only the probe pass's own rounding).
    return {g: {f: 0.0 if f == "bf16" else c for f, c in per_f.items()} for g, per_f in costs.items()}


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


def _parse_tail(spec: str, text: str, arg: str | None) -> PolicySpec:
    if arg is None:
        return PolicySpec(text, "tail")
    if not arg.strip().isdigit():
        raise ValueError(f"policy spec {spec!r}: expected tail:<last> with a non-negative integer, e.g. tail:4, "
                         "or plain tail to choose the count from fp4_target")
    return PolicySpec(text, "tail", ends=(0, int(arg)))


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
    if ps.switch:
        return _make_switch(ps, ctx, costs, previous)
    return ps.policy.make(ps, ctx, costs, previous)


def check_policy_context(spec: str, ctx: PlanContext) -> None:
    """What ``parse_policy`` cannot check without the run's context (the controller calls it at start-up):
    ``<ILP policy>+switch`` needs exactly two candidates. The switch moves FP4 GEMMs to the one
    high-precision candidate; with more, the ILP's plan would hold formats the switch cannot keep
    apart. ValueError naming the candidates and the fix otherwise."""
    ps = parse_policy(spec)
    if ps.switch and ps.policy.needs_costs and len(ctx.candidates) != 2:
        raise ValueError(f"snip.policy={spec!r} needs exactly two candidate formats (a high-precision one and an "
                         f"FP4 one); got snip.formats={list(ctx.candidates)}: keep one non-FP4 format, or use "
                         f"{spec[: -len(SWITCH)]!r} without {SWITCH!r}")


def cost_curve(spec: str, ctx: PlanContext, costs: Costs | None, grid: Sequence[Fraction]) -> list[Fraction | float]:
    """C(s) at each FP4 share of ``grid`` for the run-level budget (``snip/budget.py``): an ILP
    policy's optimal objective at ``fp4_target = s`` on ``costs`` (``math.inf`` where no plan reaches
    s); a static rule's ``s`` itself (no measured costs: every FP4 FLOP alike, so its curve is linear
    and the allocation bang-bang). A ``<rule>+switch`` is NVIDIA's recipe in time whatever its rule,
    so ``snip+switch`` takes the linear curve too: it spends the share over the run as ``tail+switch``
    does and differs from it only in the plan it starts from."""
    ps = parse_policy(spec)
    if ps.switch or not ps.policy.needs_costs:
        return list(grid)
    if costs is None:
        raise ValueError(f"policy {spec!r} needs costs (per-GEMM, per-format) for its cost curve; got costs=None")
    problem = ilp.build_problem(costs, ctx.linear_numel, ctx.candidates, float(grid[0]), ctx.granularity,
                                ctx.stage_of_layer)
    return [obj for _, obj in ilp.pareto_curve(problem, [float(x) for x in grid],
                                               max_deterministic_time=ctx.max_deterministic_time,
                                               num_workers=ctx.num_workers, seed=ctx.seed)]


def _make_switch(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                 previous: PrecisionPlan | None) -> PrecisionPlan:
    """``<rule>+switch``: the rule at this share when it is >= the run target, else the rule's plan at
    the run target with GEMMs promoted down to this share (``rules.switch_entries``). An ILP rule
    solves on ``costs`` (warm-started from ``previous``) both times."""
    check_policy_context(ps.spec, ctx)
    rule = replace(ps, spec=ps.spec[: -len(SWITCH)], switch=False)
    rho = ctx.fp4_target if ctx.run_target is None else ctx.run_target
    if ctx.fp4_target >= rho:
        plan = rule.policy.make(rule, ctx, costs, previous)
        return replace(plan, policy=ps.spec, extra=tuple(sorted({**dict(plan.extra), "switched": False}.items())))
    base = rule.policy.make(rule, replace(ctx, fp4_target=rho), costs, previous)
    return _static_plan(ps, ctx, switch_entries(ctx, base.as_dict()), switched=True,
                        switch_base_share=base.fp4_flops_share)


# --------------------------------------------------------------------------------------
# Static policies
# --------------------------------------------------------------------------------------
def _static_plan(ps: PolicySpec, ctx: PlanContext, entries: Mapping[GemmId, str], **extra: Any) -> PrecisionPlan:
    return PrecisionPlan.create(entries, ctx.linear_numel, step=ctx.step, policy=ps.spec,
                                extra={"fp4_target": ctx.fp4_target, **_time_extra(ctx, entries), **extra})


def _time_extra(ctx: PlanContext, entries: Mapping[GemmId, str]) -> dict[str, Any]:
    """Under a GEMM-time target: the budget and the plan's modeled GEMM-time ratio (what it costs)."""
    if ctx.time_cost is None:
        return {}
    return {"time_budget": ctx.time_budget, "gemm_time_ratio": ctx.time_ratio(entries)}


def _check_static(ps: PolicySpec, ctx: PlanContext) -> None:
    """The static rules put GEMMs in two candidates (fast and high precision): InfeasibleError unless
    the candidates, and then all-fast, meet the targets (the message names the cheapest value)."""
    ilp.check_feasible(ctx.candidates, ctx.fp4_target)
    if ctx.time_cost is not None:
        fastest = uniform_entries(ctx, ctx.fp4_format)
        if not Targets(ctx).meets(fastest):
            raise ilp.InfeasibleError(
                f"time_budget={ctx.time_budget} cannot be met by policy {ps.spec!r}: even every GEMM in its fast "
                f"candidate {ctx.fp4_format!r} takes {ctx.time_ratio(fastest):.4g} of BF16 time; raise "
                f"snip.time_budget to at least that or add a faster candidate")


def _make_bf16(ps: PolicySpec, ctx: PlanContext, costs: Costs | None, previous: PrecisionPlan | None) -> PrecisionPlan:
    return _static_plan(ps, ctx, uniform_entries(ctx, "bf16"), note=_EXEMPT)


def _make_uniform(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                  previous: PrecisionPlan | None) -> PrecisionPlan:
    assert ps.format is not None
    # A reference, not held to the targets: under a time target the plan reports its GEMM-time ratio.
    note = {} if ps.format in FP4_FORMATS else {"note": _EXEMPT}
    return _static_plan(ps, ctx, uniform_entries(ctx, ps.format), **note)


def _make_bf16_ends(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                    previous: PrecisionPlan | None) -> PrecisionPlan:
    _check_static(ps, ctx)
    entries, (first, last) = bf16_ends_entries(ctx, ps.ends)
    return _static_plan(ps, ctx, entries, ends_first=first, ends_last=last)


def _make_layer_type(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                     previous: PrecisionPlan | None) -> PrecisionPlan:
    _check_static(ps, ctx)
    return _static_plan(ps, ctx, layer_type_entries(ctx, ps.protected))


def _make_tail(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
               previous: PrecisionPlan | None) -> PrecisionPlan:
    _check_static(ps, ctx)
    entries, count = tail_entries(ctx, None if ps.ends is None else ps.ends[1])
    return _static_plan(ps, ctx, entries, tail_blocks=count)


def _make_attn_protected(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                         previous: PrecisionPlan | None) -> PrecisionPlan:
    _check_static(ps, ctx)
    return _static_plan(ps, ctx, layer_type_entries(ctx, ATTENTION))


def _make_mlp_only(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                   previous: PrecisionPlan | None) -> PrecisionPlan:
    _check_static(ps, ctx)
    return _static_plan(ps, ctx, mlp_only_entries(ctx))


def _make_random(ps: PolicySpec, ctx: PlanContext, costs: Costs | None,
                 previous: PrecisionPlan | None) -> PrecisionPlan:
    _check_static(ps, ctx)
    return _static_plan(ps, ctx, random_entries(ctx), seed=ctx.seed)


# --------------------------------------------------------------------------------------
# ILP policies
# --------------------------------------------------------------------------------------
def _ilp_plan(
    ps: PolicySpec,
    ctx: PlanContext,
    costs: Mapping[GemmId, Mapping[str, float]] | None,
    previous: PrecisionPlan | None,
) -> PrecisionPlan:
    ilp.check_feasible(ctx.candidates, ctx.fp4_target, time_cost=ctx.time_cost, time_budget=ctx.time_budget)
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
        ctx.candidates,  # under a time budget, less the formats slower than BF16 (snip/context.py)
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
    extra.update(_time_extra(ctx, sol.assignment))
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
    Policy("tail", ("tail", "tail:<last>"), _parse_tail, _make_tail),
    Policy("attn_protected", ("attn_protected",), _parse_plain, _make_attn_protected),
    Policy("mlp_only", ("mlp_only",), _parse_plain, _make_mlp_only),
    Policy("layer_type", ("layer_type", "layer_type:<linear>[,<linear>...]"), _parse_layer_type, _make_layer_type),
    Policy("random", ("random",), _parse_plain, _make_random),
    Policy("min_rel_err", ("min_rel_err",), _parse_plain, _ilp_plan, statistics="errors",
           costs=lambda snapshot, weight_divergence_weight: relative_error_costs(snapshot)),
    Policy("snip", ("snip",), _parse_plain, _ilp_plan, statistics="all", costs=snip_costs),
    Policy("truth", ("truth",), _parse_plain, _ilp_plan, statistics="truth", costs=truth_costs),
)})
# ``<rule>+switch`` (module docstring): the rules whose plan a run-level budget's switch can promote
# (``truth`` is left out: an oracle of one process, not a recipe).
SWITCH = "+switch"
SWITCHABLE = ("bf16_ends", "tail", "attn_protected", "mlp_only", "layer_type", "random", "min_rel_err", "snip")
POLICY_FORMS: tuple[str, ...] = tuple(form for p in POLICIES.values() for form in p.forms)


__all__ = [
    "DEFAULT_PROTECTED",
    "POLICIES",
    "POLICY_FORMS",
    "SWITCH",
    "SWITCHABLE",
    "PlanContext",
    "Policy",
    "PolicySpec",
    "SolveTimeoutError",
    "check_policy_context",
    "cost_curve",
    "make_plan",
    "needs_costs",
    "parse_policy",
    "policy_costs",
]
