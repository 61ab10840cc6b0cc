"""What every policy plans against: the model's decision units, the candidates and the target.

``PlanContext`` holds the FP4-share target and the optional GEMM-time budget (issue #23), and the
time model both are checked with:

* **Time cost** ``t_f``: relative linear-GEMM time per FLOP of format f against BF16 (1.0) on the
  target GPU and backend (``precision/capability.gemm_time_costs``, or ``snip.time_costs``).
* **GEMM-time ratio** of a plan: sum_g w_g t_f(g) / sum_g w_g t_bf16, w_g the GEMM's K*N.
* Under a time budget, candidates slower than BF16 (formats the device and backend would run
  emulated) are left out of every plan (``candidates``): a format that costs more than BF16 never
  helps meet a budget, so no plan chooses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from megatron_snip.config import SnipConfig, parse_time_costs
from megatron_snip.parallel.topology import stage_of_layer
from megatron_snip.precision import capability
from megatron_snip.precision.backends import support
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import LINEARS, GemmId
from megatron_snip.snip import problem


@dataclass(frozen=True)
class PlanContext:
    """Everything a policy needs besides costs.

    Attributes:
        num_layers: number of transformer blocks (global).
        linear_numel: K*N per linear (``model.shapes.linear_numel``): each GEMM's FLOP weight.
        formats: candidate formats, e.g. ("fp8", "nvfp4"); may include "bf16".
        fp4_target: rho in [0, 1], validated here (the boundary of the policies and the ILP;
            past it, ``ilp`` only asserts it). 0 under ``snip.target = "gemm_time"``.
        granularity: "gemm" or "layer" (decision unit of ILP, ``random`` and ``layer_type``).
        stage_of_layer: layer -> pipeline stage, or None (single stage / no per-stage target).
        seed: seed of ``random`` and of CP-SAT.
        step: training step the plan is made at.
        max_deterministic_time, num_workers: CP-SAT settings (see ``ilp.solve``).
        time_cost, time_budget: optional GEMM-time budget: the plan's GEMM-time ratio must be
            <= time_budget (globally and per stage); ``time_cost`` covers "bf16" and the candidates.
        fair_share: static policies protect units in their rule's order down to the targets.
        run_target: under a run-level budget (``snip.budget = "run"``) the run's FP4 share rho, while
            ``fp4_target`` is this interval's share (``snip/budget.py``); None under the plan budget.
            ``<rule>+switch`` plans promote GEMMs below it.
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
    run_target: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"PlanContext.num_layers={self.num_layers!r} must be a positive integer")
        object.__setattr__(self, "formats", tuple(self.formats))
        problem.check_formats(self.formats)
        problem.check_share("fp4_target", self.fp4_target)
        if self.run_target is not None:
            problem.check_share("run_target", self.run_target)
        if self.granularity not in problem.GRANULARITIES:
            raise ValueError(f"PlanContext.granularity={self.granularity!r} must be one of {problem.GRANULARITIES}")
        missing = [lin for lin in LINEARS if lin not in self.linear_numel]
        if missing:
            raise ValueError(f"PlanContext.linear_numel lacks {missing}; use model.shapes.linear_numel(shapes)")
        object.__setattr__(self, "linear_numel", MappingProxyType(dict(self.linear_numel)))
        if self.stage_of_layer is not None:
            absent = [layer for layer in range(self.num_layers) if layer not in self.stage_of_layer]
            if absent:
                raise ValueError(f"PlanContext.stage_of_layer has no stage for layer(s) {absent[:8]}")
            object.__setattr__(self, "stage_of_layer", MappingProxyType(dict(self.stage_of_layer)))
        if (self.time_cost is None) != (self.time_budget is None):
            raise ValueError("PlanContext.time_cost and time_budget go together; pass both (or neither)")
        if self.time_cost is not None:
            object.__setattr__(self, "time_cost", MappingProxyType(dict(self.time_cost)))
            self.check_time_budget()

    @classmethod
    def for_run(cls, snip: SnipConfig, num_layers: int, linear_numel: Mapping[str, int], pp: int, *,
                step: int = 0, backend: str = "emulated", sm: tuple[int, int] | None = None,
                **snip_overrides: Any) -> PlanContext:
        """The plan context of a run, the one place config and topology become a ``PlanContext``.

        Candidates, targets, granularity, seed and CP-SAT time come from ``snip`` (with any
        ``snip_overrides`` of its fields, validated as the config is), the per-stage split of the
        ``num_layers`` blocks over ``pp`` pipeline stages from ``parallel.topology.stage_of_layer``.
        ``linear_numel``: K*N per linear (``model.shapes.linear_numel``). ``backend`` and ``sm``
        (the target GPU's compute capability; None: this process's CUDA device) give the time costs
        of a GEMM-time target when ``snip.time_costs`` does not (``run_time_costs``).
        """
        if snip_overrides:
            snip = replace(snip, **snip_overrides)
        timed = snip.target != "fp4_share"
        return cls(num_layers=num_layers, linear_numel=linear_numel, formats=tuple(snip.formats),
                   fp4_target=snip.fp4_target if snip.target != "gemm_time" else 0.0, granularity=snip.granularity,
                   stage_of_layer=stage_of_layer(num_layers, pp), seed=snip.seed, step=step,
                   max_deterministic_time=snip.solver_max_time, fair_share=snip.fair_share,
                   time_cost=run_time_costs(snip, backend, sm) if timed else None,
                   time_budget=snip.time_budget if timed else None,
                   run_target=snip.fp4_target if snip.budget == "run" else None)

    def at_step(self, step: int) -> PlanContext:
        """This context for a plan made at ``step``."""
        return replace(self, step=step)

    def with_share(self, share: float) -> PlanContext:
        """This context for a plan at FP4 share ``share`` (a run-level budget's interval share; the run
        target stays ``run_target``)."""
        return replace(self, fp4_target=share)

    # --- candidates ---------------------------------------------------------------------
    @property
    def candidates(self) -> tuple[str, ...]:
        """The formats a plan may use: ``formats``, less those slower than BF16 under a time budget."""
        if self.time_cost is None:
            return self.formats
        return tuple(f for f in self.formats if self.time_cost[f] <= self.time_cost["bf16"])

    @property
    def high_format(self) -> str:
        """The high-precision candidate: the non-FP4 candidate (if several, ``bf16`` when listed, else
        the first listed; ``bf16`` when there is none)."""
        high = [f for f in self.candidates if f not in FP4_FORMATS]
        if not high:
            return "bf16"
        return "bf16" if "bf16" in high else high[0]

    @property
    def fp4_format(self) -> str:
        """The fast candidate of the static policies: the first FP4 candidate; without one, under a
        time budget, the fastest other candidate (the first listed among equals; the high-precision
        one when it is the only candidate)."""
        for f in self.candidates:
            if f in FP4_FORMATS:
                return f
        others = [f for f in self.candidates if f != self.high_format]
        if self.time_cost is not None:  # a lone candidate is both (every GEMM in it)
            return min(others, key=lambda f: self.time_cost[f]) if others else self.high_format
        raise problem.InfeasibleError(
            f"this policy puts GEMMs in FP4 but no FP4 format is among formats={list(self.formats)}; "
            f"add one of {sorted(FP4_FORMATS)}"
            + ("" if self.time_cost is None else " or a candidate faster than the high-precision one")
        )

    # --- time -----------------------------------------------------------------------------
    def check_time_budget(self) -> None:
        """InfeasibleError naming the cheapest achievable GEMM-time ratio unless the candidates can
        meet ``time_budget`` (and the FP4 floor with it)."""
        assert self.time_cost is not None and self.time_budget is not None
        for f in (*self.formats, "bf16"):
            t = self.time_cost.get(f)
            if t is None or not t > 0:
                raise ValueError(f"time cost of {f!r} is {t!r}; the time costs must give a positive relative GEMM time "
                                 f"for every candidate and for 'bf16' (snip.time_costs, e.g. ['bf16=1', 'fp8=0.5'])")
        slow = [f for f in self.formats if f not in self.candidates]
        if not self.candidates:
            cheapest = min(self.time_cost[f] for f in self.formats) / self.time_cost["bf16"]
            raise problem.InfeasibleError(
                f"time_budget={self.time_budget} cannot be met: every candidate {list(self.formats)} is slower than "
                f"BF16 on the target GPU and backend (time costs {dict(self.time_cost)}: run emulated); the cheapest "
                f"achievable is {cheapest:.4g} of BF16 time. Add 'bf16' or a format the GPU runs natively to "
                f"snip.formats, or use a backend that runs them (precision.backend)")
        try:
            problem.check_feasible(self.candidates, self.fp4_target, time_cost=self.time_cost,
                                   time_budget=self.time_budget)
        except problem.InfeasibleError as e:
            why = f" ({slow} left out: slower than BF16 on the target GPU and backend)" if slow else ""
            raise problem.InfeasibleError(f"{e}{why}") from None

    def time_ratio(self, entries: Mapping[GemmId, str]) -> float:
        """Modeled GEMM-time ratio of ``entries`` against the same GEMMs in BF16 (needs ``time_cost``)."""
        assert self.time_cost is not None
        return gemm_time_ratio(entries, self.linear_numel, self.time_cost)


def gemm_time_ratio(entries: Mapping[GemmId, str], linear_numel: Mapping[str, int],
                    time_cost: Mapping[str, float]) -> float:
    """sum_g w_g t_f(g) / sum_g w_g t_bf16 over ``entries`` (w_g = its linear's K*N)."""
    total = sum(linear_numel[g.linear] for g in entries)
    return sum(linear_numel[g.linear] * time_cost[f] for g, f in entries.items()) / (total * time_cost["bf16"])


def run_time_costs(snip: SnipConfig, backend: str, sm: tuple[int, int] | None = None) -> dict[str, float]:
    """The time costs of a run's GEMM-time target: ``snip.time_costs`` if given, else the table of
    ``precision/capability.py`` for ``backend`` on a GPU of compute capability ``sm`` (None: this
    process's CUDA device). ValueError naming the fix when neither exists (a CPU run)."""
    given = parse_time_costs(snip.time_costs)
    if given:
        return given
    if sm is None:
        sm = support.device_compute_capability()
    if sm is None:
        raise ValueError(
            f"config snip.target={snip.target!r} needs the GEMM time costs of the target GPU, but this run has no "
            f"CUDA device; set snip.time_costs (e.g. [\"bf16=1\", \"fp8=0.5\"] for H100/H200, see "
            f"precision/capability.py GEMM_TIME_RATIO) or snip.target=\"fp4_share\"")
    return capability.gemm_time_costs(backend, snip.formats, sm)


__all__ = ["PlanContext", "gemm_time_ratio", "run_time_costs"]
