"""The dry run's GEMM-time lines (issue #23): what a config's plans buy on the GPU it is checked against.

``gemm_time_lines(cfg, sizing)`` renders the modeled linear-GEMM time of the initial plan and of
SNIP's target as a ratio to the same GEMMs in BF16, the share of linear FLOPs that would run
emulated, and a warning when a plan would be slower than BF16.

Each GEMM is priced on its own (``GemmPrices``): a format the backend runs on this GPU's tensor
cores costs the datasheet ratio (``capability.GEMM_TIME_RATIO``) where the GEMM's TP-local shapes
pass the backend's shape rule (the torch backend: cuBLAS's scaled-mm rule,
``capability.gemm_runs_native``), and the emulated GEMM's cost (``capability.emulated_gemm_time_ratio``:
an fp32 GEMM without tensor cores) where they do not. ``snip.time_costs`` (e.g. the figures
``scripts/gpu_time_ratios.py`` measured) replaces the whole table, per format.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_snip.config import Config, parse_time_costs
from megatron_snip.model.shapes import linear_numel, local_linear_shapes, model_linear_shapes
from megatron_snip.precision.capability import gemm_time_cost
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import GEMMS, LINEARS
from megatron_snip.sizing.result import Sizing


class GemmPrices:
    """GEMM time per FLOP against BF16 of each (linear, gemm) in each format, for one config on
    ``s.gpu`` (every block has the same shapes, so a (linear, gemm) pair stands for all layers)."""

    def __init__(self, cfg: Config, s: Sizing, formats: Iterable[str]) -> None:
        self.formats = tuple(dict.fromkeys(("bf16", *formats)))
        self.numel = linear_numel(model_linear_shapes(cfg.model))
        given = parse_time_costs(cfg.snip.time_costs)
        tokens = cfg.training.micro_batch_size * cfg.training.seq_len
        local = local_linear_shapes(model_linear_shapes(cfg.model), s.tp)
        self.source = ("snip.time_costs" if given else
                       f"{s.backend} backend on {s.gpu.name}: datasheet ratios"
                       + (", scaled-mm shape rule per GEMM" if s.backend == "torch" else ""))
        self.cost: dict[tuple[str, str, str], float] = {
            (f, lin, g): (given[f] if f in given else gemm_time_cost(s.backend, f, s.gpu.sm, g, *local[lin], tokens))
            for f in self.formats for lin in LINEARS for g in GEMMS}
        self.bf16 = self.cost[("bf16", LINEARS[0], GEMMS[0])]

    def _weight(self) -> int:
        return sum(self.numel[lin] for lin in LINEARS) * len(GEMMS)

    def ratio(self, fmt: str) -> float:
        """A uniform plan's GEMM time against BF16 (FLOP-weighted over the linears' GEMMs)."""
        return (sum(self.numel[lin] * self.cost[(fmt, lin, g)] for lin in LINEARS for g in GEMMS)
                / (self._weight() * self.bf16))

    def emulated(self, fmt: str) -> list[str]:
        """The "linear.gemm"s that ``fmt`` would run slower than BF16 (emulated)."""
        return [f"{lin}.{g}" for lin in LINEARS for g in GEMMS if self.cost[(fmt, lin, g)] > self.bf16]

    def emulated_share(self, fmt: str) -> float:
        """Share of linear FLOPs a uniform ``fmt`` plan would run emulated."""
        return (sum(self.numel[lin] for lin in LINEARS for g in GEMMS if self.cost[(fmt, lin, g)] > self.bf16)
                / self._weight())

    def unit(self, fmt: str, lin: str, gemms: tuple[str, ...]) -> float:
        """Mean cost of one decision unit (a linear's ``gemms``) in ``fmt``, against BF16."""
        return sum(self.cost[(fmt, lin, g)] for g in gemms) / (len(gemms) * self.bf16)


def gemm_time_lines(cfg: Config, s: Sizing) -> list[str]:
    """What the plans buy on ``s.gpu``: the modeled linear-GEMM time of the initial plan and of SNIP's
    target as a ratio to the same GEMMs in BF16 (``GemmPrices``), the share of linear FLOPs that would
    run emulated, a warning when slower.

    For an FP4-share target the best case is shown: rho of the FLOPs in the fastest FP4 candidate, the
    rest in the fastest candidate; under a time budget, formats slower than BF16 are never chosen."""
    sn = cfg.snip
    prices = GemmPrices(cfg, s, s.formats_used)
    slow = {f for f in prices.formats if prices.ratio(f) > 1.0}
    out = [f"GEMM time   per FLOP vs BF16 ({prices.source}): "
           + ", ".join(f"{f} {prices.ratio(f):.3g}" for f in prices.formats)
           + (f"; {sorted(slow)} emulated (slower than BF16)" if slow else "")]
    for f in prices.formats:
        part = prices.emulated(f)
        if part and f not in slow:  # native in general, emulated where the shape rule refuses the shapes
            out.append(f"  {f} runs emulated for {', '.join(part)} ({prices.emulated_share(f):.0%} of linear "
                       f"FLOPs): the backend's shape rule refuses these TP-local shapes; priced as emulated")
    spec = cfg.precision.initial_plan
    fmt = "bf16" if spec == "bf16" else spec.split(":", 1)[1] if spec.startswith("uniform:") else None
    if fmt is not None:
        ratio = prices.ratio(fmt)
        out.append(f"  initial plan {spec}: {ratio:.3g} of BF16 GEMM time, "
                   f"{prices.emulated_share(fmt):.0%} of linear FLOPs emulated")
        if ratio > 1.0:
            out.append(f"  WARNING: the initial plan would run SLOWER than BF16 on {s.gpu.name} ({ratio:.3g}x): "
                       f"{fmt} runs emulated there (an fp32 GEMM without tensor cores); use a GPU/backend that "
                       f"runs it natively (docs/precision.md)")
    if not sn.enabled:
        return out
    rho = sn.fp4_target if sn.target != "gemm_time" else 0.0
    usable = [f for f in sn.formats if sn.target == "fp4_share" or f not in slow]
    fp4 = [f for f in usable if f in FP4_FORMATS]
    if not usable or (rho > 0 and not fp4):
        out.append(f"  SNIP target {sn.target}: cannot be met with candidates {list(sn.formats)} on this GPU "
                   f"(formats slower than BF16 are left out of a time budget); the run would stop at start-up")
        return out
    fast_all = min(usable, key=prices.ratio)
    fast4 = min(fp4, key=prices.ratio) if fp4 else fast_all
    best = rho * prices.ratio(fast4) + (1 - rho) * prices.ratio(fast_all)
    if sn.target == "gemm_time":  # every unit in its fastest candidate its shapes allow
        kinds, names = s.snip.unit_kinds, s.snip.unit_names
        if any(not set(allowed) & set(usable) for _, allowed in kinds):
            best = float("inf")
        else:
            best = (sum(w * min(prices.unit(f, lin, gemms) for f in allowed if f in usable)
                        for (w, allowed), (lin, gemms) in zip(kinds, names)) / sum(w for w, _ in kinds))
    emulated = rho * prices.emulated_share(fast4) + (1 - rho) * prices.emulated_share(fast_all)
    what = ([f"FP4 share >= {rho:g}"] * (sn.target != "gemm_time")
            + [f"GEMM time <= {sn.time_budget:g}"] * (sn.target != "fp4_share"))
    line = f"  SNIP target {' and '.join(what)} with {list(sn.formats)}: "
    if sn.target == "fp4_share":
        line += (f"at best {best:.3g} of BF16 GEMM time ({rho:g} in {fast4}, the rest in {fast_all}), "
                 f"at least {emulated:.0%} of linear FLOPs emulated")
    else:
        line += (f"at most {sn.time_budget:g} of BF16 GEMM time (cheapest achievable {best:.3g}), nothing emulated"
                 + ("" if best <= sn.time_budget else " - INFEASIBLE: the run would stop at start-up"))
    out.append(line)
    if sn.target == "fp4_share" and best > 1.0:
        out.append(f"  WARNING: this plan would run SLOWER than BF16 on {s.gpu.name} ({best:.3g}x): its "
                   f"{fast4 if fast4 in slow else fast_all} GEMMs run emulated here (an fp32 GEMM without tensor "
                   f"cores); use a GPU/backend that runs {fast4} natively, or snip.target=\"gemm_time\" with "
                   f"candidates this GPU runs (e.g. [\"bf16\", \"fp8\"] on Hopper)")
    return out


__all__ = ["GemmPrices", "gemm_time_lines"]
