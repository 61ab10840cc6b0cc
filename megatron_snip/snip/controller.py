"""The SNIP controller: periodic re-planning at step boundaries.

A trainer callback. At step ``snip.warmup`` and every ``snip.interval`` steps after it,
before that step's forward pass:

    collect statistics (snip/stats.py) -> costs (snip/metrics.py) -> policy / ILP
    (snip/policies.py) -> trainer.apply_plan(plan)

Baseline policies go through the same path (static ones skip the statistics).
Each plan is written to ``<run_dir>/plans/step_<N>.json`` (by the trainer), its statistics
snapshot next to it as ``step_<N>_stats.json``, and a PNG precision map as ``step_<N>.png``.
A failed or timed-out solve keeps the previous plan and says why. The schedule is a
function of the step and the plan is checkpointed by the trainer, so a resumed run
continues with the same plan and the same re-plan steps.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from megatron_snip.atomic_io import atomic_write_text
from megatron_snip.config import Config
from megatron_snip.parallel import comm
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip import ilp
from megatron_snip.snip.costs import linear_numel, model_linear_shapes
from megatron_snip.snip.gather import reduce_snapshot
from megatron_snip.snip.metrics import policy_costs, predicted_divergence
from megatron_snip.snip.policies import PlanContext, SolveTimeoutError, make_plan, parse_policy
from megatron_snip.snip.stats import ProbeConfig, StatsCollector


def is_replan_step(step: int, warmup: int, interval: int) -> bool:
    """Re-plan at warmup, warmup + interval, warmup + 2*interval, ..."""
    return step >= warmup and (step - warmup) % interval == 0


def draw_micro_batches(dataset: Any, start: int, count: int, size: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` consecutive micro-batches of ``size`` sequences from sequence ``start`` of
    ``dataset``, each (size, S+1) tokens on ``device``."""
    return [dataset.batch(start + i * size, size).to(device) for i in range(count)]


class SnipController:
    """Trainer callback making and applying precision plans (see module docstring)."""

    def __init__(self, cfg: Config, trainer: Any) -> None:
        self.cfg = cfg
        s = cfg.snip
        self.policy = s.policy
        self.spec = parse_policy(s.policy)  # ValueError on a bad spec, before training starts
        ilp.check_feasible(s.formats, s.fp4_target)
        self.collector = StatsCollector(ProbeConfig(formats=tuple(s.formats), noise_draws=s.noise_draws,
                                                   propagation_sequences=s.propagation_sequences, seed=s.seed,
                                                   compiled_quantizers=cfg.precision.compile_quantizers))
        self.plans_dir = Path(cfg.training.run_dir) / "plans"
        self.linear_numel = linear_numel(model_linear_shapes(cfg.model))
        self.replans = trainer.extra_state.get("snip", {}).get("replans", 0)  # restored by a resume

    # --- callback API -----------------------------------------------------------------
    def before_step(self, trainer: Any, step: int) -> None:
        s = self.cfg.snip
        if is_replan_step(step, s.warmup, s.interval):
            self.replan(trainer, step)

    def after_step(self, trainer: Any, step: int) -> None:
        pass

    def on_train_end(self, trainer: Any) -> None:
        if not trainer.is_writer:
            return
        from megatron_snip.telemetry.plots import plot_precision_map, plot_timeline

        final_map = Path(self.cfg.training.run_dir) / "precision_map.png"
        plot_precision_map(trainer.plan, final_map, title=f"final plan ({trainer.plan.policy}, step {trainer.plan.step})")
        if trainer.wandb is not None:
            trainer.wandb.log_final_plan(trainer.plan, final_map, step=trainer.step)
        timeline = Path(self.cfg.training.run_dir) / "timeline.png"
        plot_timeline(trainer.plan_history, timeline)
        if trainer.wandb is not None:
            trainer.wandb.log_timeline(timeline, step=trainer.step)

    # --- one re-plan ----------------------------------------------------------------------
    def needs_stats(self) -> bool:
        return self.spec.name in ("snip", "min_rel_err")

    def probe_batches(self, trainer: Any, step: int) -> list[torch.Tensor]:
        """``snip.probe_batches`` micro-batches of ``snip.probe_micro_batch_size`` sequences
        starting at this step's data (this DP rank's share)."""
        n, size = self.cfg.snip.probe_batches, self.cfg.probe_micro_batch_size()
        start = step * self.cfg.training.global_batch_size + trainer.topo.dp_rank * n * size
        return draw_micro_batches(trainer.data.train, start, n, size, trainer.device)

    def replan(self, trainer: Any, step: int) -> PrecisionPlan:
        """Collect (every rank) -> reduce -> metrics + solve (global rank 0) -> broadcast -> apply
        (every rank, same step). Returns the plan in force afterwards."""
        topo = trainer.topo
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        trainer.logger.info(f"re-plan at step {step}: starting (policy {self.policy}, re-plan {self.replans + 1})")
        snapshot = None
        if self.needs_stats():
            # The local-error baseline needs only the measured errors, not curvature or propagation.
            local = self.collector.collect(trainer, self.probe_batches(trainer, step), step,
                                           noise_passes=self.spec.name == "snip")
            snapshot = reduce_snapshot(local, topo)
            timings.update({f"stats_{k}": v for k, v in local["timings"].items()})
            timings["stats_s"] = time.perf_counter() - t0
        previous = trainer.plan
        decision: dict[str, Any] = {}
        if topo.rank == 0:
            decision = self._decide(snapshot, step, previous, timings)
        decision = comm.broadcast_object(decision, 0, topo.world_group)
        timings.update(decision.get("timings", {}))
        if "error" in decision:
            trainer.logger.info(f"re-plan at step {step}: {decision['error']}; keeping the previous plan {previous.hash}")
            return previous
        plan = PrecisionPlan.from_json_dict(decision["plan"])  # checks the broadcast hash
        hashes = comm.all_gather_object(plan.hash, topo.world_group)
        if len(set(hashes)) != 1:
            raise RuntimeError(f"ranks disagree on the plan made at step {step}: hashes {sorted(set(hashes))}")
        if plan.solver_status == "TIMEOUT":
            trainer.logger.info(f"re-plan at step {step}: CP-SAT timed out without a solution; keeping plan {plan.hash}")
            return previous
        t1 = time.perf_counter()
        trainer.apply_plan(plan)
        timings["apply_s"] = time.perf_counter() - t1
        timings["replan_total_s"] = time.perf_counter() - t0
        self.replans += 1
        self._record(trainer, plan, snapshot, timings, decision.get("predicted"))
        return plan

    def _decide(self, snapshot: dict | None, step: int, previous: PrecisionPlan,
                timings: dict[str, float]) -> dict[str, Any]:
        """Metrics and solve on global rank 0: {"plan": json, "predicted", "timings"} or {"error"}."""
        s = self.cfg.snip
        t1 = time.perf_counter()
        costs = None
        if snapshot is not None:
            costs = policy_costs(self.spec.name, snapshot, s.weight_divergence_weight)
            bad = [g.key for g, per_format in costs.items() if not all(math.isfinite(c) for c in per_format.values())]
            if bad:  # a NaN/inf cost would make the ILP invalid; the old plan stays
                return {"error": f"non-finite SNIP statistics for {len(bad)} GEMM(s), e.g. {bad[:3]}"}
        out_timings = {"metrics_s": time.perf_counter() - t1}
        ctx = PlanContext(num_layers=self.cfg.model.num_layers, linear_numel=self.linear_numel, formats=tuple(s.formats),
                          fp4_target=s.fp4_target, granularity=s.granularity, seed=s.seed, step=step,
                          max_deterministic_time=s.solver_max_time,
                          stage_of_layer=stage_map(self.cfg.model.num_layers, self.cfg.parallel.pp))
        t1 = time.perf_counter()
        try:
            plan = make_plan(self.policy, ctx, costs, previous=previous if previous.policy == self.policy else None)
        except (SolveTimeoutError, ilp.InfeasibleError) as e:
            return {"error": f"solve failed ({e})"}
        out_timings["solve_s"] = time.perf_counter() - t1
        predicted = predicted_divergence(costs, plan.as_dict()) if costs is not None else None
        return {"plan": plan.to_json_dict(), "predicted": predicted, "timings": out_timings}

    def _record(self, trainer: Any, plan: PrecisionPlan, snapshot: dict | None, timings: dict[str, float],
                predicted: float | None) -> None:
        step = plan.step
        changed = "" if len(trainer.plan_history) < 2 else \
            f", {sum(a != b for (_, a), (_, b) in zip(trainer.plan_history[-2].entries, plan.entries))} GEMMs changed"
        trainer.logger.info(
            f"re-plan at step {step}: policy {plan.policy}, FP4 share {plan.fp4_flops_share:.3f}, "
            f"formats {plan.format_counts()}, objective {plan.objective if plan.objective is None else round(plan.objective, 4)}"
            f" ({plan.solver_status}){changed}, took {timings['replan_total_s']:.2f}s")
        metrics = {"replan_fp4_share": plan.fp4_flops_share, **{f"replan_{k}": v for k, v in timings.items()}}
        if predicted is not None:
            metrics["predicted_divergence"] = predicted
        trainer.logger.log_metrics(step, metrics)
        trainer.extra_state["snip"] = {"replans": self.replans, "last_timings": timings, "last_stats": snapshot}
        if not trainer.is_writer:
            return
        if snapshot is not None:
            atomic_write_text(self.plans_dir / f"step_{step:06d}_stats.json", json.dumps(snapshot))
        from megatron_snip.telemetry.plots import plot_precision_map

        png = self.plans_dir / f"step_{step:06d}.png"
        plot_precision_map(plan, png)
        if trainer.wandb is not None:
            costs = None if snapshot is None else policy_costs(self.spec.name, snapshot,
                                                                self.cfg.snip.weight_divergence_weight)
            trainer.wandb.log_plan(plan, png, costs=costs)


def stage_map(num_layers: int, pp: int) -> dict[int, int] | None:
    """layer -> pipeline stage for an even split, or None with one stage."""
    if pp <= 1:
        return None
    per = num_layers // pp
    return {layer: layer // per for layer in range(num_layers)}
