"""The dry run's GEMM-time lines (issue #23): what a config's plans buy on the GPU it is checked against.

``gemm_time_lines(cfg, sizing)`` renders the modeled linear-GEMM time of the initial plan and of
SNIP's target as a ratio to the same GEMMs in BF16 (``precision/capability.gemm_time_costs`` for the
config's backend on ``sizing.gpu``, or ``snip.time_costs``), the share of linear FLOPs that would run
emulated, and a warning when a plan would be slower than BF16.
"""

from __future__ import annotations

from megatron_snip.config import Config, parse_time_costs
from megatron_snip.precision.capability import gemm_time_costs
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.sizing.result import Sizing


def gemm_time_lines(cfg: Config, s: Sizing) -> list[str]:
    """What the plans buy on ``s.gpu``: the modeled linear-GEMM time of the initial plan and of SNIP's
    target as a ratio to the same GEMMs in BF16 (``capability.gemm_time_costs`` for the config's backend,
    or ``snip.time_costs``), the share of linear FLOPs that would run emulated, a warning when slower.

    For an FP4-share target the best case is shown: rho of the FLOPs in the fastest FP4 candidate, the
    rest in the fastest candidate; under a time budget, formats slower than BF16 are never chosen."""
    sn = cfg.snip
    costs = parse_time_costs(sn.time_costs) or gemm_time_costs(s.backend, s.formats_used, s.gpu.sm)
    src = "snip.time_costs" if sn.time_costs else f"{s.backend} backend on {s.gpu.name}, capability.GEMM_TIME_RATIO"
    slow = {f for f, t in costs.items() if t > costs["bf16"]}
    out = [f"GEMM time   per FLOP vs BF16 ({src}): " + ", ".join(f"{f} {t:g}" for f, t in costs.items())
           + (f"; {sorted(slow)} emulated (slower than BF16)" if slow else "")]
    spec = cfg.precision.initial_plan
    fmt = "bf16" if spec == "bf16" else spec.split(":", 1)[1] if spec.startswith("uniform:") else None
    if fmt is not None:
        out.append(f"  initial plan {spec}: {costs[fmt] / costs['bf16']:.3g} of BF16 GEMM time, "
                   f"{1.0 if fmt in slow else 0.0:.0%} of linear FLOPs emulated")
    if not sn.enabled:
        return out
    rho = sn.fp4_target if sn.target != "gemm_time" else 0.0
    usable = [f for f in sn.formats if sn.target == "fp4_share" or f not in slow]
    fp4 = [f for f in usable if f in FP4_FORMATS]
    if not usable or (rho > 0 and not fp4):
        out.append(f"  SNIP target {sn.target}: cannot be met with candidates {list(sn.formats)} on this GPU "
                   f"(formats slower than BF16 are left out of a time budget); the run would stop at start-up")
        return out
    fast_all = min(usable, key=costs.__getitem__)
    fast4 = min(fp4, key=costs.__getitem__) if fp4 else fast_all
    best = (rho * costs[fast4] + (1 - rho) * costs[fast_all]) / costs["bf16"]
    if sn.target == "gemm_time":  # every unit in its fastest candidate its shapes allow
        kinds = s.snip.unit_kinds
        if any(not set(allowed) & set(usable) for _, allowed in kinds):
            best = float("inf")
        else:
            best = (sum(w * min(costs[f] for f in allowed if f in usable) for w, allowed in kinds)
                    / (sum(w for w, _ in kinds) * costs["bf16"]))
    emulated = rho * (fast4 in slow) + (1 - rho) * (fast_all in slow)
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
        out.append(f"  WARNING: this plan would run SLOWER than BF16 on {s.gpu.name} ({best:.3g}x): its FP4 GEMMs run "
                   f"emulated here; use a GPU/backend that runs {fast4} natively, or snip.target=\"gemm_time\" "
                   f"with candidates this GPU runs (e.g. [\"bf16\", \"fp8\"] on Hopper)")
    return out


__all__ = ["gemm_time_lines"]
