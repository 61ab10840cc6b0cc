"""Where a run's precision plans are recorded: the plan history, ``plans/`` in the run directory,
the log and metrics lines of a re-plan, the precision maps, W&B and the callbacks' checkpointed
state (``extra_state``, e.g. the SNIP controller's under ``"snip"``).

One ``PlanRecorder`` per rank, owned by the ``Trainer``. Every rank keeps the history and the
extra state (both go into its checkpoint shard); only the writer (global rank 0) writes files
and logs to W&B.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_snip.atomic_io import atomic_write_text
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.snip.host import Replan
from megatron_snip.telemetry.logger import RunLogger
from megatron_snip.telemetry.sinks import Sinks


class PlanRecorder:
    """The plan history and its files under ``run_dir/plans/`` (see the module docstring)."""

    def __init__(self, run_dir: Path, is_writer: bool, logger: RunLogger, sinks: Sinks | None) -> None:
        self.run_dir = run_dir
        self.is_writer = is_writer
        self.logger = logger
        self.sinks = sinks  # W&B / TensorBoard
        self.plan_history: list[PrecisionPlan] = []
        self.extra_state: dict[str, Any] = {}  # callbacks' checkpointed state (e.g. the SNIP controller's)

    def record(self, plan: PrecisionPlan) -> None:
        """Add the plan now in force to the history (checkpointed, the timeline) and, on the
        writer, to the run directory as ``plans/step_<N>.json``."""
        self.plan_history.append(plan)
        if self.is_writer:
            atomic_write_text(self.run_dir / "plans" / f"step_{plan.step:06d}.json", plan.to_json())

    def record_replan(self, replan: Replan) -> None:
        """The one place a re-plan is recorded: a kept plan is one log line; a new plan goes to the
        history and ``plans/step_<N>.json``, a log line, a metrics line, the checkpointed
        ``extra_state["snip"]``, and on the writer the snapshot ``plans/step_<N>_stats.json``, the
        precision map ``plans/step_<N>.png`` and W&B."""
        step = replan.step
        if not replan.applied:
            self.logger.info(f"re-plan at step {step}: {replan.kept}")
            return
        plan, timings = replan.plan, dict(replan.timings or {})
        self.record(plan)
        objective = plan.objective if plan.objective is None else round(plan.objective, 4)
        self.logger.info(
            f"re-plan at step {step}: policy {plan.policy}, FP4 share {plan.fp4_flops_share:.3f}, "
            f"formats {plan.format_counts()}, objective {objective} ({plan.solver_status}), "
            f"{replan.gemms_changed} GEMMs changed, took {timings['replan_total_s']:.2f}s")
        metrics = {"replan_fp4_share": plan.fp4_flops_share, **{f"replan_{k}": v for k, v in timings.items()}}
        extra = dict(plan.extra)
        if extra.get("budget") == "run":  # snip.budget="run" (snip/budget.py): the share over time, what is left
            self.logger.info(
                f"run budget at step {step}: interval share {extra['budget_interval_share']:.4f} until step "
                f"{extra['budget_interval_end']}, run target {extra['run_target']}, spent {extra['budget_spent']:.4f}, "
                f"unspent after this interval {extra['budget_unspent']:.4f}; schedule {extra['budget_schedule']}"
                + (f" ({extra['budget_note']})" if "budget_note" in extra else ""))
            metrics.update({"budget_interval_share": extra["budget_interval_share"],
                            "budget_spent": extra["budget_spent"], "budget_unspent": extra["budget_unspent"]})
        if replan.reused_micro_batches:
            metrics["replan_reused_micro_batches"] = replan.reused_micro_batches
        if replan.predicted_divergence is not None:
            metrics["predicted_divergence"] = replan.predicted_divergence
        snapshot = replan.snapshot or {}
        if "probe_sq_grad" in snapshot:  # the probe gradient the plan follows: a spike shows (probe_gradient_warning)
            metrics["replan_probe_grad_norm"] = math.sqrt(snapshot["probe_sq_grad"])
            metrics["replan_update_norm"] = math.sqrt(snapshot["total_sq_update"])
        self.logger.log_metrics(step, metrics)
        self.extra_state["snip"] = {"replans": replan.count, "last_timings": timings, "last_stats": replan.snapshot,
                                    **(replan.controller_state or {})}
        if not self.is_writer:
            return
        plans_dir = self.run_dir / "plans"
        if replan.snapshot is not None:
            atomic_write_text(plans_dir / f"step_{step:06d}_stats.json", json.dumps(replan.snapshot))
        from megatron_snip.telemetry.plots import plot_precision_map

        png = plans_dir / f"step_{step:06d}.png"
        plot_precision_map(plan, png)
        if self.sinks is not None:
            self.sinks.log_plan(plan, png, costs=replan.costs)

    def record_summary(self, plan: PrecisionPlan, step: int) -> None:
        """End of run, on the writer: ``precision_map.png`` (``plan``, the final one) and
        ``timeline.png`` (every recorded plan), both also to W&B at ``step``."""
        if not self.is_writer:
            return
        from megatron_snip.telemetry.plots import plot_precision_map, plot_timeline

        final_map = self.run_dir / "precision_map.png"
        plot_precision_map(plan, final_map, title=f"final plan ({plan.policy}, step {plan.step})")
        timeline = self.run_dir / "timeline.png"
        plot_timeline(self.plan_history, timeline)
        if self.sinks is not None:
            self.sinks.log_final_plan(plan, final_map, step=step)
            self.sinks.log_timeline(timeline, step=step)

    # --- checkpointed state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint entries this recorder owns (JSON-like: plans as their JSON dicts)."""
        return {"plan_history": [p.to_json_dict() for p in self.plan_history], "extra": self.extra_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint shard's ``plan_history`` and ``extra`` entries."""
        self.plan_history = [PrecisionPlan.from_json_dict(p) for p in state["plan_history"]]
        self.extra_state = dict(state.get("extra") or {})
