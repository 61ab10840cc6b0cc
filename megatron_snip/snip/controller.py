"""The SNIP controller: periodic re-planning at step boundaries.

A training-loop callback on a ``SnipHost`` (``snip/host.py``). At step ``snip.warmup`` and every
``snip.interval`` steps after it, before that step's forward pass:

    collect statistics (snip/stats.py) -> costs (snip/metrics.py) -> policy / ILP
    (snip/policies.py) -> host.apply_plan(plan) -> host.record_replan(Replan)

Baseline policies go through the same path (static ones skip the statistics; which passes a
policy needs is its ``Policy.statistics`` in the registry; the ``truth`` oracle measures its
divergences instead, ``snip/truth.py``). ``replan`` returns the outcome as a
``Replan`` value and the host records it in one place (the plan JSON
``<run_dir>/plans/step_<N>.json``, its statistics snapshot ``step_<N>_stats.json``, the precision
map ``step_<N>.png``, the metrics line, W&B and the checkpointed state). A failed or timed-out
solve keeps the previous plan and says why. The schedule is a function of the step and the plan is
checkpointed by the host, so a resumed run continues with the same plan and the same re-plan steps.
Under ``snip.budget = "run"`` each re-plan first chooses its interval's FP4 share from the plan
history and the policy's cost curve (``snip/budget.py``), and the schedule
gains a re-plan at the WSD decay onset. Under ``snip.cost_ema > 0`` a plan is solved from the moving
average of the costs of the re-plans so far (``snip/cost_memory.py``), checkpointed with the counter;
``snip.forward_stickiness`` and ``snip.forward_depth_prior`` adjust the costs the ILP solves
(``snip/priors.py``, ``solver_costs``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from megatron_snip.config import Config
from megatron_snip.data.device_batches import BatchLoader
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.parallel import comm
from megatron_snip.precision.plan import GemmId, PrecisionPlan
from megatron_snip.snip import cost_memory, ilp, priors, truth
from megatron_snip.snip.budget import RunBudget, weight_divergence_weight_at
from megatron_snip.snip.gather import reduce_snapshot
from megatron_snip.snip.host import Replan, SnipHost, TokenSource
from megatron_snip.snip.metrics import predicted_divergence
from megatron_snip.snip.policies import (
    PlanContext,
    SolveTimeoutError,
    check_policy_context,
    cost_curve,
    make_plan,
    parse_policy,
    policy_costs,
)
from megatron_snip.snip.stats import ProbeConfig, StatsCollector


def is_replan_step(step: int, warmup: int, interval: int) -> bool:
    """Re-plan at warmup, warmup + interval, warmup + 2*interval, ..."""
    return step >= warmup and (step - warmup) % interval == 0


def draw_micro_batches(dataset: TokenSource, start: int, count: int, size: int,
                       device: torch.device | None) -> list[torch.Tensor]:
    """``count`` consecutive micro-batches of ``size`` sequences from sequence ``start`` of
    ``dataset``, each (size, S+1) tokens: on ``device`` (pinned and non-blocking on CUDA:
    ``data.device_batches``), or on the host for ``device=None``."""
    host = [dataset.batch(start + i * size, size) for i in range(count)]
    if device is None:
        return host
    loader = BatchLoader(device)
    return [loader.load(b) for b in host]


def probe_gradient_warning(snapshot: dict[str, Any], grad_clip: float) -> str | None:
    """A warning when training would clip the probe batches' mean gradient to less than half, else None.

    ``snapshot["probe_sq_grad"]``: its squared norm over the whole model (a DP mean under data
    parallelism). The statistics model AdamW's update from that gradient unclipped. A clip near
    the norm only rescales the update, and the weight divergence is relative to the update, but a
    gradient training would cut to less than half (norm > 2 x ``grad_clip``) is a spike: in one of
    few probe batches it sets both the update norm the weight divergence is divided by and which
    blocks look sensitive (a measured case: docs/results/bf16_time/results.md). ``grad_clip`` = 0
    (no clipping) never warns."""
    norm = math.sqrt(snapshot.get("probe_sq_grad", 0.0))  # absent from truth / older snapshots
    if grad_clip <= 0 or not norm > 2 * grad_clip:
        return None
    return (f"warning: the probe batches' mean gradient has norm {norm:.3g}, over twice training.grad_clip="
            f"{grad_clip:g}: training would clip such a spike, the statistics use it as it is, so this plan "
            f"follows {snapshot['num_probe_batches']} probe batch(es); more snip.probe_batches dilute one, and "
            f"snip.preconditioner=with_probe bounds its preconditioned update as AdamW's next step does")


def reusable_micro_batches(probes: list[torch.Tensor], micro: list[torch.Tensor]) -> int:
    """How many of a step's first micro-batches ``micro`` are also its first probe batches ``probes``
    (the same tokens, in order): those the statistics' reference pass can hand to the step
    (``snip.reuse_step``). Both lists hold (B, S+1) token tensors of this rank."""
    k = 0
    for probe, own in zip(probes, micro):
        if probe.shape != own.shape or not torch.equal(probe, own):
            break
        k += 1
    return k


class SnipController:
    """Training-loop callback making and applying precision plans (see module docstring).

    ``host`` is the ``SnipHost`` it will run on (the constructor reads only its restored
    ``extra_state``; the callbacks receive it again); every check of ``cfg.snip`` happens here, before training starts.
    """

    def __init__(self, cfg: Config, host: SnipHost) -> None:
        self.cfg = cfg
        s = cfg.snip
        self.policy = s.policy
        self.spec = parse_policy(s.policy)  # ValueError on a bad spec, before training starts
        self.context = PlanContext.for_run(s, cfg.model.num_layers, linear_numel(model_linear_shapes(cfg.model)),
                                           cfg.parallel.pp, backend=cfg.precision.backend)
        check_policy_context(s.policy, self.context)
        # The statistics measure exactly the formats a plan may choose: under a time target, not the ones
        # slower than BF16 on the target GPU (PlanContext.candidates), so none of them sets the noise
        # scale or the metrics' normalization (the harshest format). The snapshot's "formats" lists them.
        self.collector = StatsCollector(ProbeConfig(formats=self.context.candidates, noise_draws=s.noise_draws,
                                                   propagation_sequences=s.propagation_sequences, seed=s.seed,
                                                   curvature_noise=s.curvature_noise, loss_first_order=s.loss_first_order,
                                                   weight_divergence=s.weight_divergence,
                                                   preconditioner=s.preconditioner,
                                                   compiled_quantizers=cfg.precision.compile_quantizers))
        if self.spec.policy.statistics == "truth":
            truth.check_single_process(host.topo.world_size, f"snip.policy={s.policy!r}")
        restored = host.extra_state.get("snip", {})  # the controller's state, restored by a resume
        self.replans = restored.get("replans", 0)
        # snip.cost_ema: the costs the plans applied so far were solved from (global rank 0's; None before the first)
        self.cost_memory = cost_memory.from_state(restored.get("cost_memory"))
        # snip.budget="run" (snip/budget.py); the references (bf16, uniform:<f>) are exempt from any FP4 target
        self.budget = RunBudget.for_run(cfg) if s.budget == "run" and self.spec.name not in ("bf16", "uniform") else None

    # --- callback API -----------------------------------------------------------------
    def before_step(self, host: SnipHost, step: int) -> None:
        s = self.cfg.snip
        if is_replan_step(step, s.warmup, s.interval) or (self.budget is not None and self.budget.is_replan_step(step)):
            host.record_replan(self.replan(host, step))

    def after_step(self, host: SnipHost, step: int) -> None:
        pass

    def on_train_end(self, host: SnipHost) -> None:
        host.record_plan_summary()

    # --- one re-plan ----------------------------------------------------------------------
    def probe_batches(self, host: SnipHost, step: int, count: int | None = None) -> list[torch.Tensor]:
        """``count`` (default ``snip.probe_batches``; the ``truth`` policy's ``snip.truth_batches``)
        micro-batches of ``snip.probe_micro_batch_size`` sequences starting at this step's data
        (this DP rank's share), on the host (``host.load_batch`` takes them to the device)."""
        n = self.cfg.snip.probe_batches if count is None else count
        size = self.cfg.probe_micro_batch_size()
        start = step * self.cfg.training.global_batch_size + host.topo.dp_rank * n * size
        return draw_micro_batches(host.train_data, start, n, size, None)

    def replan(self, host: SnipHost, step: int) -> Replan:
        """Collect (every rank) -> reduce -> metrics + solve (global rank 0) -> broadcast -> apply
        (every rank, same step). Returns the outcome (the same plan on every rank); records nothing."""
        topo = host.topo
        statistics = self.spec.policy.statistics
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        host.logger.info(f"re-plan at step {step}: starting (policy {self.policy}, re-plan {self.replans + 1})")
        snapshot = None
        reused = 0
        if statistics == "truth":
            batches = [host.load_batch(b) for b in self.probe_batches(host, step, self.cfg.snip.truth_batches)]
            snapshot = truth.measure(host, batches, self.context.candidates, step)
            timings.update(snapshot["timings"])
            timings["stats_s"] = time.perf_counter() - t0
        elif statistics is not None:
            on_host = self.probe_batches(host, step)
            if self.cfg.snip.reuse_step:  # compared on the host: no device read
                reused = reusable_micro_batches(on_host, host.micro_batches(step, on_host=True))
            probes = [host.load_batch(b) for b in on_host]
            local, reference = self.collector.collect_with_reference(host, probes, step, reused,
                                                                     noise_passes=statistics == "all")
            if reference is not None:
                host.reuse_reference(reference)
            snapshot = reduce_snapshot(local, topo)
            warning = probe_gradient_warning(snapshot, self.cfg.training.grad_clip)
            if warning is not None:
                host.logger.info(f"re-plan at step {step}: {warning}")
            timings.update({f"stats_{k}": v for k, v in local["timings"].items()})
            timings["stats_s"] = time.perf_counter() - t0
        previous = host.plan
        decision: dict[str, Any] = {}
        costs = None  # the costs stay on global rank 0 (the writer); only the decision is broadcast
        if topo.rank == 0:
            decision, costs = self._decide(snapshot, step, previous, host.plan_history)
        t1 = time.perf_counter()
        decision = comm.broadcast_object(decision, 0, topo.world_group)
        timings.update(decision.get("timings", {}))
        timings["broadcast_s"] = time.perf_counter() - t1
        if "error" in decision:
            return Replan(step, previous, kept=f"{decision['error']}; keeping the previous plan {previous.hash}",
                          snapshot=snapshot, timings=timings, reused_micro_batches=reused)
        plan = PrecisionPlan.from_json_dict(decision["plan"])  # checks the broadcast hash
        hashes = comm.all_gather_object(plan.hash, topo.world_group)
        if len(set(hashes)) != 1:
            raise RuntimeError(f"ranks disagree on the plan made at step {step}: hashes {sorted(set(hashes))}")
        if plan.solver_status == "TIMEOUT":
            return Replan(step, previous, kept=f"CP-SAT timed out without a solution; keeping plan {plan.hash}",
                          snapshot=snapshot, timings=timings, reused_micro_batches=reused)
        t1 = time.perf_counter()
        host.apply_plan(plan)
        timings["apply_s"] = time.perf_counter() - t1
        timings["replan_total_s"] = time.perf_counter() - t0
        self.replans += 1
        state = None
        if self.cfg.snip.cost_ema > 0 and costs is not None:  # remembered only once its plan is applied
            self.cost_memory = costs
            state = {"cost_memory": cost_memory.to_state(costs)}
        changed = sum(a != b for (_, a), (_, b) in zip(previous.entries, plan.entries))
        return Replan(step, plan, snapshot=snapshot, timings=timings, predicted_divergence=decision.get("predicted"),
                      gemms_changed=changed, count=self.replans, costs=costs, reused_micro_batches=reused,
                      controller_state=state)

    def _decide(self, snapshot: dict | None, step: int, previous: PrecisionPlan,
                history: list[PrecisionPlan]) -> tuple[dict[str, Any], dict[GemmId, dict[str, float]] | None]:
        """Metrics and solve on global rank 0: ({"plan": json, "predicted", "timings"} or {"error"}, the costs
        the plan is solved from: this re-plan's, averaged with the memory under ``snip.cost_ema``).
        ``history``: the plans in force so far, in order (the run budget's spent share)."""
        t1 = time.perf_counter()
        costs = None
        if snapshot is not None:
            costs = policy_costs(self.spec.name, snapshot, weight_divergence_weight_at(self.cfg, step))
            bad = [g.key for g, per_format in costs.items() if not all(math.isfinite(c) for c in per_format.values())]
            if bad:  # a NaN/inf cost would make the ILP invalid; the old plan stays
                return {"error": f"non-finite SNIP statistics for {len(bad)} GEMM(s), e.g. {bad[:3]}"}, None
            costs = cost_memory.smoothed(costs, self.cost_memory, self.cfg.snip.cost_ema)
        # what the ILP solves (the memory and the predicted divergence keep the measured costs)
        solved = None if costs is None else priors.solver_costs(costs, self.cfg.snip, self.cfg.model.num_layers,
                                                                previous.as_dict())
        stickiness, depth = self.cfg.snip.forward_stickiness, self.cfg.snip.forward_depth_prior
        out_timings = {"metrics_s": time.perf_counter() - t1}
        t1 = time.perf_counter()
        ctx = self.context.at_step(step)
        spend = None
        try:
            if self.budget is not None:
                curve = cost_curve(self.policy, ctx, solved, self.budget.grid)
                out_timings["budget_curve_s"] = time.perf_counter() - t1
                spend = self.budget.decide(step, history, self.context.linear_numel, curve)
                ctx = ctx.with_share(float(spend.share))
            plan = make_plan(self.policy, ctx, solved, previous=previous if previous.policy == self.policy else None)
        except (SolveTimeoutError, ilp.InfeasibleError) as e:
            return {"error": f"solve failed ({e})"}, costs
        if spend is not None and plan.solver_status != "TIMEOUT":  # a kept plan keeps its own record
            plan = plan.with_extra(spend.extra())
        if self.cfg.snip.weight_divergence_lr_scaled and costs is not None and plan.solver_status != "TIMEOUT":
            plan = plan.with_extra({"weight_divergence_weight": weight_divergence_weight_at(self.cfg, step)})
        if self.cfg.snip.cost_ema > 0 and costs is not None and plan.solver_status != "TIMEOUT":
            plan = plan.with_extra({"cost_ema": self.cfg.snip.cost_ema})
        if stickiness > 0 and costs is not None and plan.solver_status != "TIMEOUT":
            plan = plan.with_extra({"forward_stickiness": stickiness})
        if depth > 0 and costs is not None and plan.solver_status != "TIMEOUT":
            plan = plan.with_extra({"forward_depth_prior": depth})
        out_timings["solve_s"] = time.perf_counter() - t1
        predicted = predicted_divergence(costs, plan.as_dict()) if costs is not None else None
        return {"plan": plan.to_json_dict(), "predicted": predicted, "timings": out_timings}, costs
