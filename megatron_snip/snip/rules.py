"""The static policies' rules (``bf16_ends``, ``tail``, ``layer_type``, ``attn_protected``, ``mlp_only``,
``random``, ``uniform``): which GEMMs go
to the fast candidate, as entries GemmId -> format. ``snip/policies.py`` documents each rule and
turns the entries into plans.

Every rule meets the context's targets: the FP4 share ``rho`` and, when ``ctx.time_cost`` is set,
the GEMM-time budget (``Targets``: exact integer checks, the same rounding as the ILP's, so a
rule's plan and an ILP plan satisfy the same constraints). Without a time budget the rules are
exactly those of before the budget existed (tests/unit/test_plan_golden.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction

import numpy as np

from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import GEMMS, LINEARS, GemmId, all_gemm_ids
from megatron_snip.snip import problem
from megatron_snip.snip.context import PlanContext

DEFAULT_PROTECTED = ("fc2", "proj")  # layer_type's protected linears
ATTENTION = ("qkv", "proj")  # attn_protected's protected linears; the linears mlp_only keeps out of FP4


class Targets:
    """Exact checks of the targets over a set of GEMMs (one stage, or the whole model)."""

    def __init__(self, ctx: PlanContext) -> None:
        self.ctx = ctx
        self.t = None if ctx.time_cost is None else problem.time_ints(ctx.time_cost, (*ctx.candidates, "bf16"))

    def time_of(self, entries: Mapping[GemmId, str]) -> int:
        assert self.t is not None
        return sum(self.ctx.linear_numel[g.linear] * self.t[f] for g, f in entries.items())

    def time_cap(self, gemms: Iterable[GemmId]) -> int:
        assert self.t is not None and self.ctx.time_budget is not None
        weight = sum(self.ctx.linear_numel[g.linear] for g in gemms)
        return problem.time_cap(self.ctx.time_budget, self.t["bf16"], weight)

    def meets(self, entries: Mapping[GemmId, str]) -> bool:
        """FP4 share >= rho and (with a budget) GEMM time <= budget over ``entries``' GEMMs."""
        if not _meets(entries, self.ctx.linear_numel, self.ctx.fp4_target):
            return False
        return self.t is None or self.time_of(entries) <= self.time_cap(entries)


def uniform_entries(ctx: PlanContext, fmt: str) -> dict[GemmId, str]:
    return {g: fmt for g in all_gemm_ids(ctx.num_layers)}


def _by_layer(ctx: PlanContext, high_layers: set[int]) -> dict[GemmId, str]:
    hi, lo = ctx.high_format, ctx.fp4_format
    return {g: hi if g.layer in high_layers else lo for g in all_gemm_ids(ctx.num_layers)}


def bf16_ends_entries(ctx: PlanContext, ends: tuple[int, int] | None) -> tuple[dict[GemmId, str], tuple[int, int]]:
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
        # Every block has the same FLOPs, so the share falls (and the time grows) as the ends grow:
        # take the largest symmetric e that still meets the targets (closest from above).
        first = last = 0
        for e in range(1, (num_layers + 1) // 2 + 1):
            trial = _by_layer(ctx, _ends(num_layers, e, e))
            if Targets(ctx).meets(trial):
                first = last = e
            else:
                break
    return _by_layer(ctx, _ends(num_layers, first, last)), (first, last)


def tail_entries(ctx: PlanContext, count: int | None) -> tuple[dict[GemmId, str], int]:
    """The last blocks in the high-precision candidate, every other block FP4 (NVIDIA's NVFP4 recipe,
    arXiv 2509.25149 App. E: keeping the last blocks in BF16 converges where the first ones do not).

    ``count``: exactly the last ``count`` blocks (a fixed recipe, honoured even if it misses rho).
    None: with ``fair_share`` every unit starts FP4 and units are protected from the last block
    backwards (L-1, L-2, ..., unit by unit) while the stage still meets the targets; without it, the
    largest number of last blocks that still meets them. Returns (entries, whole blocks protected)."""
    num_layers = ctx.num_layers
    if count is not None:
        if count > num_layers:
            raise ValueError(f"policy tail:{count} keeps {count} blocks in high precision but the model has only "
                             f"num_layers={num_layers}; choose a count <= {num_layers}")
        return _by_layer(ctx, _ends(num_layers, 0, count)), count
    if ctx.fair_share:
        entries = _protect_down_to_target(ctx, sorted(_units(ctx), key=lambda u: -u[0].layer))
        whole = next((i for i in range(num_layers)
                      if not all(f == ctx.high_format for g, f in entries.items() if g.layer == num_layers - 1 - i)),
                     num_layers)
        return entries, whole
    count = 0
    for n in range(1, num_layers + 1):
        if not Targets(ctx).meets(_by_layer(ctx, _ends(num_layers, 0, n))):
            break
        count = n
    return _by_layer(ctx, _ends(num_layers, 0, count)), count


# mlp_only's top-up order within a block: forward GEMMs first (the SNIP method note: most of FP4's harm
# comes through the backward GEMMs), then dgrad, then wgrad.
_TOP_UP_GEMM = {"fprop": 0, "dgrad": 1, "wgrad": 2}


def mlp_only_entries(ctx: PlanContext) -> dict[GemmId, str]:
    """FP4 only in the MLP (fc1, fc2), attention (qkv, proj) in the high-precision candidate: MaxText's
    and Transformer Engine's NVFP4 recipes (``quantization`` applied to the MLP GEMMs only).

    Where the MLP alone misses rho, attention units are topped up into FP4 by a stated rule: forward
    GEMMs before dgrad before wgrad (with ``granularity = "layer"``, whole linears), each from the
    middle blocks outward (the ends, which NVIDIA's recipe protects, go last). With ``fair_share`` the
    same rule read backwards is the order of protection: attention units from the ends inward, wgrad
    first, then the MLP's units from the ends inward, each while the stage meets the targets."""
    block = {layer: i for i, layer in enumerate(_ends_inward(ctx.num_layers))}
    attention = [u for u in _units(ctx) if u[0].linear in ATTENTION]
    # protection order of the attention units: the reverse of the top-up order
    attention.sort(key=lambda u: (-_TOP_UP_GEMM[u[0].gemm] if len(u) == 1 else 0, block[u[0].layer]))
    if ctx.fair_share:
        mlp = sorted((u for u in _units(ctx) if u[0].linear not in ATTENTION), key=lambda u: block[u[0].layer])
        return _protect_down_to_target(ctx, attention + mlp)
    hi, lo = ctx.high_format, ctx.fp4_format
    entries = {g: hi if g.linear in ATTENTION else lo for g in all_gemm_ids(ctx.num_layers)}
    targets = Targets(ctx)
    if targets.meets(entries):
        return entries
    return _top_up(ctx, entries, attention[::-1], targets)


def switch_entries(ctx: PlanContext, base: Mapping[GemmId, str]) -> dict[GemmId, str]:
    """``<rule>+switch`` below the run target: the rule's plan at the run target (``base``), then its
    fast GEMMs promoted to the high-precision candidate while each stage's FP4 share stays >=
    ``ctx.fp4_target`` (this interval's share): forward GEMMs first, then dgrad, then wgrad (with
    ``granularity = "layer"``, whole linears), each from the last block backwards. NVIDIA's NVFP4
    recipe (arXiv 2509.25149 App. D) switches the forward GEMMs to BF16 shortly before the LR decays
    (about 2/3 of the remaining gap recovered), forward and backward together recovering all of it;
    its App. E finds the last blocks the most sensitive, hence the order within a GEMM kind."""
    hi = ctx.high_format
    units = _units(ctx)
    kept = [u for u in units if all(base[g] == hi for g in u)]
    rank = {lin: i for i, lin in enumerate(LINEARS)}
    promote = sorted((u for u in units if not all(base[g] == hi for g in u)),
                     key=lambda u: (_TOP_UP_GEMM[u[0].gemm] if len(u) == 1 else 0, -u[0].layer, rank[u[0].linear]))
    return _protect_down_to_target(ctx, kept + promote)


def _top_up(ctx: PlanContext, entries: dict[GemmId, str], order: list[tuple[GemmId, ...]],
            targets: Targets) -> dict[GemmId, str]:
    """Move units of ``order`` to the fast candidate, in order, until ``entries`` meet the targets:
    the shortest prefix that reaches rho, then (under a time budget) one unit at a time."""
    lo = ctx.fp4_format
    already = sum(ctx.linear_numel[g.linear] for g, f in entries.items() if f == lo)
    k = _prefix_to_meet(order, ctx.linear_numel, _need(entries, ctx.linear_numel, ctx.fp4_target) - already)
    for unit in order[:k]:
        for g in unit:
            entries[g] = lo
    _move_until_met(entries, order[k:], lo, targets, entries)
    return entries


def _protect_down_to_target(ctx: PlanContext, order: list[tuple[GemmId, ...]]) -> dict[GemmId, str]:
    """``fair_share``: all units in the fast candidate, then each unit of ``order`` (every unit, once)
    moves to the high-precision candidate if its stage still meets the targets (FP4 share >= rho,
    GEMM time <= budget). A unit left fast could not move, so each stage is within the weight of
    its lightest fast unit of the binding target."""
    hi, lo = ctx.high_format, ctx.fp4_format
    numel = ctx.linear_numel
    entries = {g: lo for u in order for g in u}
    stage_of = ctx.stage_of_layer or {}
    targets = Targets(ctx)
    fp4: dict[int, int] = {}
    need: dict[int, int] = {}
    time: dict[int, int] = {}
    cap: dict[int, int] = {}
    for stage in {stage_of.get(u[0].layer, 0) for u in order}:
        members = {g: lo for u in order if stage_of.get(u[0].layer, 0) == stage for g in u}
        fp4[stage], need[stage] = sum(numel[g.linear] for g in members), _need(members, numel, ctx.fp4_target)
        if targets.t is not None:
            time[stage], cap[stage] = targets.time_of(members), targets.time_cap(members)
    lo_fp4 = lo in FP4_FORMATS
    for unit in order:
        stage, weight = stage_of.get(unit[0].layer, 0), sum(numel[g.linear] for g in unit)
        if lo_fp4 and fp4[stage] - weight < need[stage]:
            continue
        if targets.t is not None:
            extra = weight * (targets.t[hi] - targets.t[lo])
            if time[stage] + extra > cap[stage]:
                continue
            time[stage] += extra
        if lo_fp4:
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


def layer_type_entries(ctx: PlanContext, protected: tuple[str, ...]) -> dict[GemmId, str]:
    if ctx.fair_share:
        block = {layer: i for i, layer in enumerate(_ends_inward(ctx.num_layers))}
        kind = {lin: i for i, lin in enumerate(protected + tuple(lin for lin in LINEARS if lin not in protected))}
        order = sorted(_units(ctx), key=lambda u: (u[0].linear not in protected, block[u[0].layer], kind[u[0].linear]))
        return _protect_down_to_target(ctx, order)
    hi, lo = ctx.high_format, ctx.fp4_format
    entries = {g: hi if g.linear in protected else lo for g in all_gemm_ids(ctx.num_layers)}
    targets = Targets(ctx)
    if targets.meets(entries):
        return entries
    # Move protected units to FP4 from the middle blocks outward; within a block the
    # last-listed (least protected) linear type goes first.
    mid = (ctx.num_layers - 1) / 2
    rank = {lin: i for i, lin in enumerate(reversed(protected))}
    movable = [u for u in _units(ctx) if u[0].linear in protected]
    movable.sort(key=lambda u: (abs(u[0].layer - mid), u[0].layer, rank[u[0].linear]))
    return _top_up(ctx, entries, movable, targets)


def random_entries(ctx: PlanContext) -> dict[GemmId, str]:
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
                group_entries[g] = lo
        _move_until_met(entries, members[k:], lo, Targets(ctx), group_entries)
    return entries


def _move_until_met(entries: dict[GemmId, str], order: list[tuple[GemmId, ...]], lo: str, targets: Targets,
                    scope: dict[GemmId, str]) -> None:
    """Under a time budget, move units of ``order`` to ``lo`` one at a time until ``scope`` (the
    entries of the GEMMs the budget is checked over, updated alongside ``entries``) meets the
    targets. Nothing to do without a budget: the FP4 prefix before it already met rho."""
    if targets.t is None:
        return
    for unit in order:
        if targets.meets(scope):
            return
        for g in unit:
            entries[g] = scope[g] = lo


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


