"""The run-level FP4 budget (``snip.budget = "run"``): how much FP4 share each re-plan interval gets.

Under ``snip.budget = "plan"`` (the default) every plan holds the FP4 share ``rho =
snip.fp4_target``. Under ``"run"`` only the run must: over the horizon of steps ``[snip.warmup,
training.max_steps)`` the step-weighted FP4 share (= token-weighted: the global batch is fixed)
must reach ``rho``, and each re-plan decides how much of what is left its interval spends.

The choice at a re-plan at step ``t`` (``plan_interval``), all in exact rational arithmetic:

* **Spent** (``spent_share_steps``): sum over the plans in force in ``[warmup, t)`` of each plan's
  FP4 share times the steps it was in force, read from the run's plan history (checkpointed), so a
  resumed run derives the same number and needs no state of its own. **Need**
  ``R = rho * H - spent``, ``H`` the horizon's length in steps.
* **Intervals**: from ``t`` to each later re-plan step (the regular schedule plus the WSD decay
  onset) and to ``max_steps``; interval ``i`` of ``len_i`` steps has the weight
  ``w_i = mean over its steps of (lr_peak / lr_step) ** p`` (``p = snip.budget_lr_power``): the
  same quantization error is assumed to cost more where the LR is small (late in the run, and in LR
  warmup) - it is not annealed away afterwards. ``p = 0`` weighs every interval alike.
* **Cost curve** ``C(s)`` over the share grid ``G`` (``snip.budget_share_range``,
  ``snip.budget_share_step``): the policy's predicted cost of a plan at share ``s`` now (SNIP: the
  ILP's optimal objective at ``fp4_target = s`` on the current statistics; a static rule: ``s``
  itself, every FP4 FLOP alike). The current curve stands for every remaining interval (the
  statistics of later steps are not known yet: each re-plan re-solves, a receding horizon).
* **Allocation** (``allocate``): one share ``s_i`` in ``G`` per interval minimising
  ``sum_i w_i len_i C(s_i)`` subject to ``sum_i len_i s_i >= R`` - a multiple-choice knapsack,
  solved by a sweep over the Lagrange multiplier ``mu`` of the budget constraint (each interval then
  picks its own share: the smallest ``mu`` whose picks reach ``R``), ties at that ``mu`` resolved
  by raising the interval with the lowest share first (so equal intervals get equal shares), then a
  greedy fix-up that lowers any share the budget can spare. Its cost is at most the optimum plus
  ``mu`` times the Lagrangian picks' overshoot of ``R`` (``Allocation.gap``, certified by the dual
  bound ``Allocation.lower_bound``). Unequal intervals make it a real knapsack, where that gap can
  be some 20% on small instances, so wherever the table is small (``DP_LIMIT``: always at the
  shipped schedules) an exact dynamic program over the share-steps, in units of the grid step times
  the lengths' gcd, replaces it; among equal costs it takes the most even shares.
* Only the current interval's share is applied. The last interval takes the exact remainder
  ``R / len`` (clamped to ``[0, high]`` only: it may fall below the grid's low end, since every
  plan rounds its share up to whole decision units and that credit comes off the end), so the run
  lands on ``rho`` up to the last plan's rounding to decision units.

Consequences, tested in ``tests/unit/test_run_budget.py``: with ``p = 0`` and a convex curve the
allocation is ``rho`` in every interval (the run budget is the plan budget); with a linear curve
(the static rules) it is bang-bang - the largest share while the LR is high, the smallest after
the LR falls, NVIDIA's "switch to BF16 before decay" (arXiv 2509.25149 App. D) as an optimum.

Pure functions (no ranks, no logging, no clocks; the LR schedule comes in as a function), and
``RunBudget``, the settings of a run read from its config.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from megatron_snip.config import Config
from megatron_snip.config.schedule import lr_at, wsd_decay_start
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import GemmId, PrecisionPlan
from megatron_snip.snip.problem import InfeasibleError

__all__ = [
    "Allocation",
    "BudgetDecision",
    "Interval",
    "RunBudget",
    "allocate",
    "decimal",
    "fp4_fraction",
    "intervals_from",
    "plan_interval",
    "replan_points",
    "share_grid",
    "spent_share_steps",
]


def decimal(x: float) -> Fraction:
    """``x`` as the decimal it prints as (0.8 -> 4/5), the reading the ILP's targets use."""
    return Fraction(repr(float(x)))


def share_grid(lo: float, hi: float, step: float) -> tuple[Fraction, ...]:
    """``lo, lo + step, ...`` up to ``hi`` (``hi`` included even when off the step), exact decimals.
    ValueError for an empty range or a non-positive step."""
    a, b, d = decimal(lo), decimal(hi), decimal(step)
    if not 0 <= a <= b <= 1:
        raise ValueError(f"share range [{lo}, {hi}] must satisfy 0 <= low <= high <= 1")
    if d <= 0:
        raise ValueError(f"share grid step {step} must be > 0")
    grid = []
    s = a
    while s < b:
        grid.append(s)
        s += d
    grid.append(b)
    return tuple(grid)


def fp4_fraction(entries: Iterable[tuple[GemmId, str]], linear_numel: Mapping[str, int]) -> Fraction:
    """A plan's FP4 FLOP share, exact (``precision.plan.fp4_flops_share`` is its float)."""
    total = fp4 = 0
    for g, f in entries:
        total += linear_numel[g.linear]
        fp4 += linear_numel[g.linear] if f in FP4_FORMATS else 0
    return Fraction(fp4, total) if total else Fraction(0)


def spent_share_steps(history: Sequence[tuple[int, Fraction]], start: int, step: int) -> Fraction:
    """FP4 share-steps spent in ``[start, step)``: ``history`` is (step made, FP4 share) of each plan
    in force, in the order applied; each is in force until the next one's step (the last until
    ``step``). A plan made at a step replaces one made earlier at the same step."""
    spent = Fraction(0)
    for k, (made, share) in enumerate(history):
        until = history[k + 1][0] if k + 1 < len(history) else step
        lo, hi = max(made, start), min(until, step)
        if hi > lo:
            spent += share * (hi - lo)
    return spent


def replan_points(warmup: int, interval: int, max_steps: int, extra: Iterable[int] = ()) -> list[int]:
    """Re-plan steps in ``[warmup, max_steps)``: warmup, warmup + interval, ..., plus ``extra``
    (e.g. the WSD decay onset), sorted."""
    points = set(range(warmup, max_steps, interval)) | {s for s in extra if warmup <= s < max_steps}
    return sorted(points)


@dataclass(frozen=True)
class Interval:
    """Steps ``[start, end)`` under one plan, with the weight ``w`` of its FP4 cost (module docstring)."""

    start: int
    end: int
    weight: Fraction

    @property
    def length(self) -> int:
        return self.end - self.start


def intervals_from(step: int, points: Iterable[int], max_steps: int, lr: Callable[[int], float],
                   lr_peak: float, power: float) -> list[Interval]:
    """The intervals from ``step`` to ``max_steps`` cut at the re-plan ``points`` after ``step``;
    weight = mean over the interval's steps of ``(lr_peak / lr(t)) ** power`` (every LR > 0)."""
    cuts = [step] + sorted(p for p in set(points) if step < p < max_steps) + [max_steps]
    out = []
    for a, b in itertools.pairwise(cuts):
        if b <= a:
            continue
        if power == 0:
            w = Fraction(1)
        else:
            vals = [lr(t) for t in range(a, b)]
            assert all(v > 0 for v in vals), f"LR <= 0 in steps [{a}, {b}): the schedule gives lr > 0"
            w = Fraction(sum((lr_peak / v) ** power for v in vals) / len(vals))
        out.append(Interval(a, b, w))
    return out


@dataclass(frozen=True)
class Allocation:
    """One share per interval (``allocate``).

    Attributes:
        shares: the grid share of each interval, in order.
        cost: sum_i w_i len_i C(s_i).
        lower_bound: the Lagrangian dual value at ``multiplier``: no allocation meeting the budget
            costs less.
        multiplier: mu, the budget's shadow price (cost per share-step).
        overshoot: sum_i len_i s_i - need (>= 0).
        gap: ``cost - lower_bound`` is at most this, so the cost is within ``gap`` of the optimum:
            mu times the overshoot of the Lagrangian picks before the fix-up (whose cost is exactly
            ``lower_bound + gap``; the fix-up and the exact program only lower it).
        exact: the shares are the optimum (the dynamic program ran).
    """

    shares: tuple[Fraction, ...]
    cost: Fraction
    lower_bound: Fraction
    multiplier: Fraction
    overshoot: Fraction
    gap: Fraction
    exact: bool = False


DP_LIMIT = 2_000_000  # interval x state x share steps up to which ``allocate`` solves exactly


def allocate(lengths: Sequence[int], weights: Sequence[Fraction], grid: Sequence[Fraction],
             curve: Sequence[float], need: Fraction, dp_limit: int = DP_LIMIT) -> Allocation:
    """Minimise sum_i weights[i] * lengths[i] * curve[s_i] over grid shares s_i with
    sum_i lengths[i] * s_i >= need (module docstring: Lagrangian sweep and greedy fix-up, replaced
    by the exact dynamic program where its table has at most ``dp_limit`` cells x options).

    ``curve[j]`` is C(grid[j]); ``math.inf`` marks a share no plan reaches (left out). ValueError for
    mismatched inputs or an empty grid; ``InfeasibleError`` when even the largest reachable share
    in every interval falls short of ``need`` (the message gives both)."""
    if not lengths or len(lengths) != len(weights):
        raise ValueError(f"allocate needs one weight per interval; got {len(lengths)} lengths, {len(weights)} weights")
    if not grid or len(grid) != len(curve):
        raise ValueError(f"allocate needs a non-empty share grid with one cost each; got {len(grid)} shares, "
                         f"{len(curve)} costs")
    finite = [j for j, c in enumerate(curve) if c != float("inf")]
    if not finite:
        raise InfeasibleError(f"no share of the grid {[float(s) for s in grid]} can be planned (every cost infinite)")
    # options[i]: (share-steps a, cost c, grid index), ascending in a
    options = [sorted((Fraction(n) * grid[j], Fraction(w) * n * Fraction(curve[j]), j) for j in finite)
               for n, w in zip(lengths, weights)]
    most = sum(opt[-1][0] for opt in options)
    if most < need:
        raise InfeasibleError(
            f"the run budget needs {float(need):.6g} FP4 share-steps in the {sum(lengths)} steps left, but the largest "
            f"reachable share {float(grid[options[0][-1][2]]):g} in every interval gives {float(most):.6g}")

    def tied(mu: Fraction) -> list[list[tuple[Fraction, Fraction, int]]]:
        out = []
        for opt in options:
            best = min(c - mu * a for a, c, _ in opt)
            out.append([o for o in opt if o[1] - mu * o[0] == best])
        return out

    def reach(mu: Fraction) -> Fraction:
        return sum(t[-1][0] for t in tied(mu))

    slopes = sorted({(c2 - c1) / (a2 - a1) for opt in options for k, (a1, c1, _) in enumerate(opt)
                     for a2, c2, _ in opt[k + 1:] if c2 > c1} | {Fraction(0)})
    lo, hi = 0, len(slopes) - 1  # reach(slopes[-1]) == most >= need: every max-share option is then a minimiser
    while lo < hi:
        mid = (lo + hi) // 2
        if reach(slopes[mid]) >= need:
            hi = mid
        else:
            lo = mid + 1
    mu = slopes[lo]
    ties = tied(mu)
    pick = [0] * len(options)  # index into ties[i]: start each at its smallest tied share
    total = sum(t[0][0] for t in ties)
    while total < need:  # raise the lowest share first (earliest on equal shares)
        i = min((k for k in range(len(ties)) if pick[k] + 1 < len(ties[k])),
                key=lambda k: (grid[ties[k][pick[k]][2]], k))
        total += ties[i][pick[i] + 1][0] - ties[i][pick[i]][0]
        pick[i] += 1
    lagrangian = [ties[i][pick[i]] for i in range(len(ties))]
    gap = mu * (sum(o[0] for o in lagrangian) - need)
    chosen = _lower_while_feasible(lagrangian, options, need)
    exact = _exact(lengths, options, need, dp_limit)
    if exact is not None:
        assert sum(c for _, c, _ in exact) <= sum(c for _, c, _ in chosen), "the program is the optimum"
        chosen = exact
    total = sum(a for a, _, _ in chosen)
    bound = sum(min(c - mu * a for a, c, _ in opt) for opt in options) + mu * need
    return Allocation(shares=tuple(grid[j] for _, _, j in chosen), cost=sum(c for _, c, _ in chosen),
                      lower_bound=bound, multiplier=mu, overshoot=total - need, gap=gap, exact=exact is not None)


def _exact(lengths: Sequence[int], options: list[list[tuple[Fraction, Fraction, int]]], need: Fraction,
           limit: int) -> list[tuple[Fraction, Fraction, int]] | None:
    """The optimum by dynamic programming over the share-steps raised above each interval's lowest
    option, in units of their common divisor (the grid step times the lengths' gcd), capped at the
    need; None when the table (intervals x states x options) would exceed ``limit``. Among equal
    costs it takes the most even shares (least sum_i len_i * s_i^2)."""
    base = sum(opt[0][0] for opt in options)
    steps = [[o[0] - opt[0][0] for o in opt] for opt in options]
    nonzero = [d for row in steps for d in row if d]
    if not nonzero:
        return [opt[0] for opt in options]
    unit = Fraction(math.gcd(*(d.numerator for d in nonzero)), math.lcm(*(d.denominator for d in nonzero)))
    cap = max(0, math.ceil((need - base) / unit))
    if len(options) * (cap + 1) * max(len(o) for o in options) > limit:
        return None
    # value[t]: (cost, evenness, picks) of the best picks so far that raise min(t, cap) units
    value: dict[int, tuple[Fraction, Fraction, tuple[int, ...]]] = {0: (Fraction(0), Fraction(0), ())}
    for n, opt, row in zip(lengths, options, steps):
        nxt: dict[int, tuple[Fraction, Fraction, tuple[int, ...]]] = {}
        for t, (cost, even, picks) in value.items():
            for k, (o, d) in enumerate(zip(opt, row)):
                u = min(cap, t + int(d / unit))
                cand = (cost + o[1], even + o[0] * o[0] / n, (*picks, k))
                if u not in nxt or cand[:2] < nxt[u][:2]:
                    nxt[u] = cand
        value = nxt
    return [opt[k] for opt, k in zip(options, value[cap][2])]


def _lower_while_feasible(picks: list[tuple[Fraction, Fraction, int]], options: list[list[tuple[Fraction, Fraction, int]]],
                          need: Fraction) -> list[tuple[Fraction, Fraction, int]]:
    """The fix-up: repeatedly the single lowering of one interval's share that saves most while the
    picks' share-steps still reach ``need``."""
    chosen, total = list(picks), sum(a for a, _, _ in picks)
    while True:
        best = None
        for i, (a, c, _) in enumerate(chosen):
            for o in options[i]:
                if o[0] < a and o[1] < c and total - a + o[0] >= need and (best is None or c - o[1] > best[0]):
                    best = (c - o[1], i, o)
        if best is None:
            return chosen
        _, i, o = best
        total += o[0] - chosen[i][0]
        chosen[i] = o


@dataclass(frozen=True)
class BudgetDecision:
    """The run budget at one re-plan (``plan_interval``); shares as exact fractions.

    Attributes:
        run_target: rho, the FP4 share the horizon must reach.
        horizon: (first step, end step) of the horizon.
        spent: FP4 share-steps spent before this re-plan, over the horizon's length (its part of rho).
        share: this interval's FP4 share target.
        interval: (start, end) steps of this interval (until the next re-plan).
        unspent: rho - spent - share * len / H: the part of rho left for the intervals after this one.
        schedule: the allocation's share for every remaining interval ((start, end, share), this one first).
        clamped: why ``share`` was clamped to the grid's range, or None.
    """

    run_target: Fraction
    horizon: tuple[int, int]
    spent: Fraction
    share: Fraction
    interval: tuple[int, int]
    unspent: Fraction
    schedule: tuple[tuple[int, int, Fraction], ...]
    clamped: str | None = None

    def extra(self) -> dict[str, object]:
        """The fields a plan records (``plan.extra``); the schedule as ``"start-end:share ..."``."""
        # scalars and strings only: a plan (a frozen dataclass) must stay hashable after a JSON round trip
        out: dict[str, object] = {
            "budget": "run", "run_target": float(self.run_target), "budget_horizon_start": self.horizon[0],
            "budget_horizon_end": self.horizon[1], "budget_spent": float(self.spent),
            "budget_interval_end": self.interval[1], "budget_interval_share": float(self.share),
            "budget_unspent": float(self.unspent),
            "budget_schedule": " ".join(f"{a}-{b}:{float(s):.4g}" for a, b, s in self.schedule)}
        if self.clamped:
            out["budget_note"] = self.clamped
        return out


def plan_interval(step: int, run_target: float, horizon: tuple[int, int], history: Sequence[tuple[int, Fraction]],
                  intervals: Sequence[Interval], grid: Sequence[Fraction], curve: Sequence[float]) -> BudgetDecision:
    """The share of the interval starting at ``step`` (``intervals[0]``), from the plans already in force
    (``history``, see ``spent_share_steps``) and the cost curve over ``grid`` (module docstring).

    The last interval takes the exact remainder (clamped to [0, the largest reachable share]); an
    allocation the grid cannot hold spends the largest share everywhere; both say so in ``clamped``
    (the run then misses or passes rho)."""
    assert intervals and intervals[0].start == step, "intervals start at the re-plan step"
    rho = decimal(run_target)
    length = horizon[1] - horizon[0]
    spent = spent_share_steps(history, horizon[0], step)
    need = rho * length - spent
    reachable = [s for s, c in zip(grid, curve) if c != float("inf")]
    if not reachable:
        raise InfeasibleError(f"no share of the grid {[float(s) for s in grid]} can be planned")
    high = max(reachable)
    clamped = None
    if len(intervals) == 1:
        # Below the range is allowed here: earlier plans round their shares up to whole decision units,
        # and where the allocation had already put the last intervals at the range's low end that credit
        # can only come off the last one. Past the top (or below 0) it cannot be planned.
        exact = need / intervals[0].length
        share = min(max(exact, Fraction(0)), high)
        if share != exact:
            clamped = (f"the exact remainder {float(exact):.6g} is outside the reachable range "
                       f"[0, {float(high):g}]")
        schedule = ((intervals[0].start, intervals[0].end, share),)
    else:
        try:
            alloc = allocate([iv.length for iv in intervals], [iv.weight for iv in intervals], grid, curve, need)
            shares = alloc.shares
        except InfeasibleError as e:  # earlier plans under-spent (e.g. a kept plan): spend all there is
            shares = (high,) * len(intervals)
            clamped = f"{e}; every interval at {float(high):g}"
        share = shares[0]
        schedule = tuple((iv.start, iv.end, s) for iv, s in zip(intervals, shares))
    here = intervals[0].length
    return BudgetDecision(run_target=rho, horizon=horizon, spent=spent / length, share=share,
                          interval=(intervals[0].start, intervals[0].end),
                          unspent=rho - (spent + share * here) / length, schedule=schedule, clamped=clamped)


@dataclass(frozen=True)
class RunBudget:
    """A run's budget settings, read from its config (``for_run``): what ``plan_interval`` needs
    besides the plan history and the cost curve.

    Attributes:
        run_target: rho (``snip.fp4_target``).
        horizon: [``snip.warmup``, ``training.max_steps``).
        points: the re-plan steps in the horizon: the regular schedule plus, under a WSD schedule,
            the decay onset (so a promotion can happen where the LR starts to fall).
        grid: the shares an interval may take (``snip.budget_share_range``, ``budget_share_step``).
        lr: the LR of each step of the run, ``lr[t]``; ``lr_peak`` its peak (``training.lr``).
        power: p of the interval weights (``snip.budget_lr_power``).
    """

    run_target: float
    horizon: tuple[int, int]
    points: tuple[int, ...]
    grid: tuple[Fraction, ...]
    lr: tuple[float, ...]
    lr_peak: float
    power: float

    @classmethod
    def for_run(cls, cfg: Config) -> RunBudget:
        s, t = cfg.snip, cfg.training
        return cls(run_target=s.fp4_target, horizon=(s.warmup, t.max_steps),
                   points=tuple(replan_points(s.warmup, s.interval, t.max_steps, _onset(cfg))),
                   grid=share_grid(s.budget_share_range[0], s.budget_share_range[1], s.budget_share_step),
                   lr=tuple(lr_at(k, t) for k in range(t.max_steps)), lr_peak=t.lr, power=s.budget_lr_power)

    def is_replan_step(self, step: int) -> bool:
        """A re-plan the budget adds to the regular schedule (the WSD decay onset) or one of it."""
        return step in self.points

    def intervals(self, step: int) -> list[Interval]:
        """The intervals from ``step`` to the end of the run (``intervals_from``)."""
        return intervals_from(step, self.points, self.horizon[1], self.lr.__getitem__, self.lr_peak, self.power)

    def decide(self, step: int, plans: Sequence[PrecisionPlan], linear_numel: Mapping[str, int],
               curve: Sequence[Fraction | float]) -> BudgetDecision:
        """This re-plan's share: ``plan_interval`` on the plans in force so far (each's exact FP4
        share from its entries) and the policy's cost curve over ``grid``."""
        history = [(p.step, fp4_fraction(p.entries, linear_numel)) for p in plans]
        return plan_interval(step, self.run_target, self.horizon, history, self.intervals(step), self.grid, curve)


def _onset(cfg: Config) -> tuple[int, ...]:
    """The re-plan the run budget adds to the regular schedule: the WSD decay onset."""
    return (wsd_decay_start(cfg.training),) if cfg.training.lr_schedule == "wsd" else ()


def plan_lr_scale(cfg: Config, step: int) -> float:
    """Mean of ``lr_t / lr_peak`` over the steps ``[step, next re-plan)`` (or to ``max_steps``) that a
    plan made at ``step`` is in force: the regular schedule (``snip.warmup`` + k ``snip.interval``),
    plus the WSD decay onset under ``snip.budget = "run"``. ``snip.weight_divergence_lr_scaled``
    multiplies lambda by it. 1.0 at constant LR; during LR warmup and decay below 1."""
    s, t = cfg.snip, cfg.training
    extra = _onset(cfg) if s.budget == "run" else ()
    later = [p for p in replan_points(s.warmup, s.interval, t.max_steps, extra) if p > step]
    end = max(later[0] if later else t.max_steps, step + 1)
    return math.fsum(lr_at(k, t) / t.lr for k in range(step, end)) / (end - step)  # exact 1.0 at the peak


def weight_divergence_weight_at(cfg: Config, step: int) -> float:
    """lambda of the costs of a re-plan at ``step``: ``snip.weight_divergence_weight``, times the plan's
    mean LR over its interval relative to the peak (``plan_lr_scale``) under
    ``snip.weight_divergence_lr_scaled`` (the controller and the offline planner's replay use this)."""
    s = cfg.snip
    return s.weight_divergence_weight * (plan_lr_scale(cfg, step) if s.weight_divergence_lr_scaled else 1.0)


def schedule_lines(cfg: Config) -> list[str]:
    """The dry run's account of a run-level budget (``snip.budget = "run"``): horizon, re-plan steps,
    interval weights, and the schedule a static rule or a ``<rule>+switch`` gets (cost linear in the
    share, ``policies.cost_curve``). Empty under the plan budget."""
    s = cfg.snip
    if s.budget != "run":
        return []
    rb = RunBudget.for_run(cfg)
    start, end = rb.horizon
    if start >= end:
        return [(f"run budget  snip.budget=\"run\" but snip.warmup={start} >= training.max_steps={end}: no re-plan, "
                f"the initial plan runs throughout")]
    ivs = rb.intervals(start)
    alloc = allocate([iv.length for iv in ivs], [iv.weight for iv in ivs], rb.grid, list(rb.grid),
                     decimal(rb.run_target) * (end - start))
    onset = f" (incl. the WSD decay onset {wsd_decay_start(cfg.training)})" if cfg.training.lr_schedule == "wsd" else ""
    return [
        (f"run budget  FP4 share {s.fp4_target:g} over steps [{start}, {end}) ({end - start} steps), each interval in "
        f"[{s.budget_share_range[0]:g}, {s.budget_share_range[1]:g}] by {s.budget_share_step:g}; cost weight "
        f"(lr_peak/lr)^{s.budget_lr_power:g}"),
        f"  re-plans at {list(rb.points)}{onset}; interval weights "
        + ", ".join(f"{iv.start}-{iv.end}: {float(iv.weight):.3g}" for iv in ivs),
        "  a static rule or a <rule>+switch (cost linear in the share) plans " + ", ".join(
            f"{iv.start}-{iv.end}: {float(x):g}" for iv, x in zip(ivs, alloc.shares))
        + "; SNIP re-solves at every re-plan on its measured cost curve",
    ]
