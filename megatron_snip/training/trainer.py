"""The training loop: data -> forward/backward over micro-batches -> guarded AdamW step.

One ``Trainer`` per rank. Everything it needs about parallelism comes from the
``ParallelTopology`` it is given; collectives live in ``parallel/``. Precision only
changes through ``apply_plan`` at a step boundary (house rule 2). The trainer is SNIP's host
(``snip/host.py``: model, optimizer state, topology, probe data, forward/backward, the plan in
force); it records plans through its ``PlanRecorder`` (``training/plan_recorder.py``: plan JSON,
statistics snapshot, precision map, log and metrics lines, W&B, checkpointed state) and keeps its
run directory (fresh-run check, checkpoint commit, the checkpoint to resume from) through a
``RunDirectory`` (``training/run_dir.py``).

Parallelism: the model is this rank's TP shard of its PP stage (``LlamaModel(layers=...,
tp=...)``); ``forward_backward`` runs the layout's schedule of ``parallel/pipeline.py`` (no
pipeline, 1F1B or GPipe); after it, ``GradReducer`` sums sequence-parallel grads over TP,
averages all grads over DP (with ``training.overlap_grad_reduce``: waits for the buckets its
hooks started during backward) and clips by the global norm over TP x PP (with
``training.distributed_optimizer``: the ZeRO-1 optimizer's reducer, which reduce-scatters instead). The loss (broadcast
from the last stage, averaged over DP) and the skip decision are identical on every rank.

Step semantics: optimizer step ``s`` (0-based) consumes global samples
``[s*G, (s+1)*G)`` of the shuffled training windows (G = global batch). Those are
split over DP ranks, then into micro-batches. The LR is a function of ``s``; a
checkpoint taken after step ``s`` resumes at ``s+1`` with identical data, RNG and
optimizer state, so resumed losses match uninterrupted ones bit for bit on CPU.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch

from megatron_snip.atomic_io import atomic_write_text
from megatron_snip.config import Config
from megatron_snip.data.dataset import GPTDataset, eval_window_batches
from megatron_snip.data.device_batches import BatchLoader
from megatron_snip.data.pipeline import DataBundle
from megatron_snip.model.llama import LlamaModel
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.parallel import comm
from megatron_snip.parallel.ddp import GradReducer, counted_once, global_norm
from megatron_snip.parallel.distributed_optimizer import DistributedOptimizer
from megatron_snip.parallel.pipeline import schedule_for
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.precision import fallbacks
from megatron_snip.precision.plan import PrecisionPlan, all_gemm_ids
from megatron_snip.snip.feasibility import check_candidates_runnable
from megatron_snip.snip.host import ReferencePass, Replan
from megatron_snip.telemetry.logger import RunLogger, step_line
from megatron_snip.telemetry.profile import StepProfiler
from megatron_snip.telemetry.sinks import Sinks
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.async_checkpoint import AsyncCheckpointer, hook_from_env
from megatron_snip.training.init_from import init_from
from megatron_snip.training.lr import lr_at
from megatron_snip.training.optim import build_optimizer
from megatron_snip.training.plan_recorder import PlanRecorder
from megatron_snip.training.preemption import (
    StopSignal,
    TrainingPreempted,
    describe_last_checkpoint,
    stop_reached_any_rank,
)
from megatron_snip.training.reference_step import reused_loss, take_reference
from megatron_snip.training.resolve import (
    build_backend,
    build_data_on_ranks,
    resolve_autocast_dtype,
    resolve_device,
    resolve_initial_plan,
)
from megatron_snip.training.run_dir import RunDirectory
from megatron_snip.training.step_guard import (
    LaggedFlags,
    LateFlags,
    LogWindow,
    StepLedger,
    StepRecord,
    StepResult,
    TrainingStopped,  # noqa: F401 (train.py and tests import it from here)
    non_finite_stop,
    optimizer_step,
    ruinous_update_stop,
    update_refused,
)
from megatron_snip.training.throughput import Throughput, peak_memory_text
from megatron_snip.training.vocab_check import model_vocab_size


class Trainer:
    """Trains one model replica shard (this rank's TP/PP piece) on its DP slice of the data."""

    def __init__(self, cfg: Config, topo: ParallelTopology | None = None, logger: RunLogger | None = None) -> None:
        self.topo = topo or ParallelTopology.single()
        self.cfg = cfg.validate(self.topo.world_size)
        if (self.topo.tp, self.topo.pp) != (cfg.parallel.tp, cfg.parallel.pp):
            raise ValueError(f"config parallel.tp={cfg.parallel.tp} parallel.pp={cfg.parallel.pp} but the process "
                             f"topology has tp={self.topo.tp} pp={self.topo.pp}; build it with "
                             f"init_distributed(cfg.parallel.tp, cfg.parallel.pp)")
        t = cfg.training
        self.run_directory = RunDirectory(self.cfg, self.topo)
        self.run_dir, self.ckpt_root = self.run_directory.path, self.run_directory.ckpt_root
        self.is_writer = self.run_directory.is_writer
        self.run_directory.check_fresh()
        self.device = resolve_device(t.device)
        self.autocast_dtype = resolve_autocast_dtype(t.dtype, self.device)

        self.data: DataBundle = build_data_on_ranks(self.cfg, self.topo, self.is_writer)
        self.vocab_size = model_vocab_size(cfg, self.data.tokenizer, self.topo.tp)

        # Same seed on every rank: each builds the full weights of its parameters and keeps its slice.
        torch.manual_seed(t.seed)
        self.tp = self.topo.tensor_parallel(cfg.parallel.sequence_parallel)
        self.model = LlamaModel(cfg.model, self.vocab_size, layers=self.topo.stage_layers(cfg.model.num_layers),
                                pre_process=self.topo.is_first_stage, post_process=self.topo.is_last_stage,
                                tp=self.tp).to(self.device)
        self.model.set_recompute(t.recompute, t.recompute_every)
        # Batches reach the device pinned and non-blocking, a step ahead; a middle stage reads no tokens.
        self.batches = BatchLoader(self.device, needs_tokens=self.topo.is_first_stage or self.topo.is_last_stage)
        self.model.set_compile(t.compile)
        self.schedule = schedule_for(self.topo, cfg.parallel.pp_schedule)
        self.optimizer = build_optimizer(self.model, t, self.device, self.topo)
        # The distributed optimizer reduces into its own DP shards (parallel/distributed_optimizer.py).
        self.grads = (self.optimizer.reducer if isinstance(self.optimizer, DistributedOptimizer)
                      else GradReducer(self.model.parameters(), self.topo, t.grad_bucket_mb,
                                       overlap=t.overlap_grad_reduce))
        # Stochastic rounding draws from one generator owned by the trainer and checkpointed. It is
        # seeded alike on every rank: DP replicas consume it identically, so DP rank 0's saved
        # state restores every replica exactly.
        self.quant_generator = torch.Generator(device=self.device).manual_seed(t.seed + 1)
        self.model.set_quant_generator(self.quant_generator)
        self.linear_numel = linear_numel(model_linear_shapes(cfg.model))
        self.throughput = Throughput(cfg, self.vocab_size, self.topo.world_size, self.device)

        self.step = 0  # optimizer steps completed
        self._param_norm = self.param_norm()  # for the post-step guard (step_guard.update_refused)
        self._stop: StopSignal | None = None  # fit's signal handler, read into each step's flags
        self._reference: ReferencePass | None = None  # a re-plan's reference pass for its step (reuse_reference)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        # Plans name every GEMM of the model; each pipeline stage applies the entries of its own layers.
        self.all_gemm_ids = all_gemm_ids(cfg.model.num_layers)
        check_candidates_runnable(cfg, self.topo.tp)  # before any step, not at the first re-plan
        self.plan: PrecisionPlan = resolve_initial_plan(cfg, self.all_gemm_ids, self.linear_numel)
        self.model.set_backend(build_backend(self.cfg, self.plan, self.device, self.topo.tp, self.autocast_dtype))
        self.model.set_tp_amax(cfg.precision.tp_amax)

        # Optional W&B / TensorBoard mirrors of metrics.jsonl and of every plan (rank 0 only; None otherwise).
        self.sinks = Sinks.from_config(cfg, self.run_dir, is_writer=self.is_writer) if logger is None else None
        self.logger = logger or RunLogger(self.run_dir, is_writer=self.is_writer,
                                          progress_total=t.max_steps if t.progress else None,
                                          sinks=[self.sinks] if self.sinks else [])
        self.recorder = PlanRecorder(self.run_dir, self.is_writer, self.logger, self.sinks)
        self.saver = (AsyncCheckpointer(self.run_directory, self.device, self.logger.info, hook_from_env())
                      if t.async_save else None)  # training.async_save: checkpoints written in the background
        for line in self.run_directory.start_notes + self.data.notes:  # start-up clean-up; how each corpus was read
            self.logger.info(line)
        resumed = self.load_latest() if t.resume else False
        if t.init_from and not resumed:  # before anything is written: a refused source leaves no run behind
            self.logger.info(init_from(t.init_from, self.model, self.optimizer, cfg,
                                       tp_rank=self.topo.tp_rank, pp_rank=self.topo.pp_rank))
            self._param_norm = self.param_norm()
        if self.is_writer:
            # A resumed run keeps the config.toml its checkpoints were made with (changes are listed in the log).
            name = "config.toml" if not resumed else f"config.resumed_step_{self.step:06d}.toml"
            atomic_write_text(self.run_dir / name, cfg.to_toml())
        self.apply_plan(self.plan)
        if not resumed:
            self.recorder.record(self.plan)

    # --- precision (the SNIP host: snip/host.py) --------------------------------------
    @property
    def num_layers(self) -> int:
        return self.cfg.model.num_layers

    @property
    def train_data(self) -> GPTDataset:
        return self.data.train

    def apply_plan(self, plan: PrecisionPlan) -> None:
        """Switch every linear to ``plan`` (call only between steps, on every rank); records nothing."""
        plan.validate(self.all_gemm_ids)
        self._check_plan_shapes(plan)
        self.model.apply_plan(plan)
        self.plan = plan

    @property
    def plan_history(self) -> list[PrecisionPlan]:
        """Every plan recorded in this run, the initial one first (checkpointed)."""
        return self.recorder.plan_history

    @property
    def extra_state(self) -> dict[str, Any]:
        """The callbacks' checkpointed state (e.g. the SNIP controller's under ``"snip"``)."""
        return self.recorder.extra_state

    def reuse_reference(self, reference: ReferencePass) -> None:
        """The next ``train_step(reference.step)`` takes its first ``reference.micro_batches``
        micro-batches' gradients from the statistics' reference pass (``snip.reuse_step``)."""
        self._reference = reference

    def record_replan(self, replan: Replan) -> None:
        """Record a re-plan's outcome (``PlanRecorder.record_replan``)."""
        self.recorder.record_replan(replan)

    def record_plan_summary(self) -> None:
        """End of run: the final precision map and the timeline (``PlanRecorder.record_summary``)."""
        self.recorder.record_summary(self.plan, self.step)

    def _check_plan_shapes(self, plan: PrecisionPlan) -> None:
        """Refuse a plan whose formats do not fit some stage's local GEMM shapes - on every rank
        at once (a stage raising alone would leave its neighbours waiting in the pipeline)."""
        t = self.cfg.training
        errors = self.model.plan_shape_errors(plan, t.micro_batch_size * t.seq_len)
        everyone = [e for errs in comm.all_gather_object(errors, self.topo.world_group) for e in errs]
        if everyone:
            more = f" (+{len(everyone) - 3} more)" if len(everyone) > 3 else ""
            raise ValueError(f"precision plan {plan.policy!r} (step {plan.step}) cannot run on this model/layout: "
                             + "; ".join(everyone[:3]) + more)

    # --- batches --------------------------------------------------------------------
    @property
    def micro_batches_per_step(self) -> int:
        t = self.cfg.training
        return t.global_batch_size // (t.micro_batch_size * self.topo.dp)

    def _rank_batch(self, step: int) -> torch.Tensor:
        """This DP rank's share of optimizer step ``step``'s global batch, (per_rank, seq_len+1) int64 on the host."""
        t = self.cfg.training
        per_rank = t.global_batch_size // self.topo.dp
        return self.data.train.batch(step * t.global_batch_size + self.topo.dp_rank * per_rank, per_rank)

    def micro_batches(self, step: int, on_host: bool = False) -> list[torch.Tensor]:
        """This DP rank's micro-batches (each (micro, seq_len+1) int64) for optimizer step ``step``:
        on the device (the copy prefetched by the step before when there is one; left on the host
        on a middle pipeline stage: ``data.device_batches``), or on the host (``on_host``)."""
        batch = (self._rank_batch(step) if on_host
                 else self.batches.take(step, lambda: self._rank_batch(step)))
        return list(batch.split(self.cfg.training.micro_batch_size))

    def load_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """A host batch (B, S+1) where this rank's stage reads it (``BatchLoader.load``)."""
        return self.batches.load(tokens)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy (fp32 scalar, with its graph) of one micro-batch (B, S+1) through the
        whole model: the SNIP statistics' single-stage passes. Training and evaluation go through
        ``forward_backward`` / ``evaluate_batch`` (any layout)."""
        assert self.topo.is_first_stage and self.topo.is_last_stage, \
            "forward_loss needs the whole model on this rank; pipelined layouts use forward_backward"
        return self._stage_forward(tokens, None)

    def _stage_forward(self, tokens: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        """This stage's part of one micro-batch (B, S+1): from the tokens on the first stage, else
        from the received activation ``x``; the mean loss on the last stage, else the activation (in the
        activation dtype: bf16 under autocast, as the residual stream runs, so it travels in half the bytes)."""
        with self._autocast():
            out = self.model(tokens[:, :-1] if self.topo.is_first_stage else x)
        if self.topo.is_last_stage:
            return self.model.loss(out, tokens[:, 1:])
        return out

    def _activation_shape(self, tokens: torch.Tensor) -> tuple[int, int, int]:
        """Shape of the hidden states passed between pipeline stages for a (B, S+1) micro-batch."""
        seq = tokens.shape[1] - 1
        if self.tp.sequence_parallel:
            seq //= self.tp.size
        return (tokens.shape[0], seq, self.cfg.model.hidden_size)

    def _run_schedule(self, micro: list[torch.Tensor], *, forward_only: bool, divisor: int | None = None) -> torch.Tensor:
        """``micro`` through this layout's schedule (``parallel.pipeline.schedule_for``); the sum of
        their losses over ``divisor`` (default ``len(micro)``: the mean loss)."""
        n = divisor or len(micro)

        def stage_step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            out = self._stage_forward(micro[i], x)
            return out / n if self.topo.is_last_stage else out

        return self.schedule(stage_step, len(micro), self.topo, activation_shape=self._activation_shape(micro[0]),
                             dtype=self.autocast_dtype or torch.float32, device=self.device, forward_only=forward_only)

    def forward_backward(self, micro: list[torch.Tensor], *, divisor: int | None = None) -> torch.Tensor:
        """Accumulate gradients of the mean loss over ``micro`` (this rank's micro-batches,
        each (B, S+1)); returns that mean loss (detached fp32 scalar, the same on every pipeline
        stage and TP rank; not averaged over DP), through this layout's schedule. ``divisor``: divide
        the summed loss by it instead of ``len(micro)`` (part of a step's micro-batches).

        No optimizer step and no gradient reduction over DP (``train_step`` does that via
        ``self.grads.reduce()``) - the SNIP statistics pass reuses this on its probe batches.
        Autocast weight copies are made once for all of ``micro`` (``LlamaModel.weight_copies_for_step``)."""
        with self.model.weight_copies_for_step():
            return self._run_schedule(micro, forward_only=False, divisor=divisor)

    @torch.no_grad()
    def evaluate_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean loss of one (B, S+1) batch without gradients; the same on every rank."""
        return self._run_schedule([tokens], forward_only=True)

    # --- one step ---------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """Forward/backward over all micro-batches, then a guarded optimizer step. The outcome stays
        on the device (``training/step_guard.py``): the skip is decided there when the optimizer
        can (a fused AdamW's ``found_inf``); else its flag is the one value a step reads. At a
        re-plan step with ``snip.reuse_step``, the micro-batches the statistics' reference pass ran
        contribute its (BF16) gradients instead of running again (``training/reference_step.py``)."""
        lr = lr_at(step, self.cfg.training)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        micro = self.micro_batches(step)
        if step + 1 < self.cfg.training.max_steps:  # the next step's copy overlaps this step's kernels
            self.batches.prefetch(step + 1, lambda: self._rank_batch(step + 1))
        reference, self._reference = self._reference, None
        reused = take_reference(reference, step, len(micro))
        self.grads.start_step(len(micro) - reused)  # the overlapped reduction counts these backward passes
        total = self.forward_backward(micro) if reused == 0 else reused_loss(reference, len(micro))
        if 0 < reused < len(micro):
            total = total + self.forward_backward(micro[reused:], divisor=len(micro))
        self.grads.reduce()
        loss = comm.all_reduce_mean(total.detach().clone().float(), self.topo.dp_group)
        clip = self.cfg.training.grad_clip or math.inf
        grad_norm = self.grads.clip_(clip).float()
        # One decision for all ranks: any rank seeing a non-finite loss or norm skips everywhere. The
        # preemption flag rides in the same all-reduce (copied to the device without a host sync).
        bad = (~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).float().reshape(())
        stop = self._stop.flag_on(bad.device) if self._stop is not None else torch.zeros((), device=bad.device)
        flags = comm.all_reduce_max(torch.stack([bad, stop]), self.topo.world_group)
        skipped = flags[0]
        optimizer_step(self.optimizer, skipped)  # NaN/Inf guard: a skip leaves weights and optimizer state untouched
        before, after = self._param_norm, self.param_norm()
        self._param_norm = after
        refused = update_refused(before, after, skipped, self.cfg.training.max_param_norm_growth)
        return StepResult(step, loss, grad_norm, skipped, flags[1], before, after, refused)

    def param_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's parameters (0-d fp32 on the device; replicated tensors
        counted once; the same on every rank)."""
        params = [p.detach() for p in self.model.parameters() if counted_once(getattr(p, "tensor_parallel", False), self.topo)]
        return global_norm(params, self.device, self.topo.mp_group)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Mean validation loss over ``eval_batches`` fixed batches per validation set, in the current plan:
        its first windows, or windows spread over the whole set (``training.eval_windows``). None when
        a stop signal came during it (inside ``fit``): the evaluation is aborted so that the
        checkpoint is written within the grace period (training/preemption.py)."""
        t = self.cfg.training
        out = {}
        self.model.eval()
        losses: dict[str, list[torch.Tensor]] = {}
        for name, ds in self.data.valid.items():
            losses[name] = []
            for batch in self.batches.ahead(eval_window_batches(ds, t.eval_batches, t.micro_batch_size, t.eval_windows)):
                # A stop that came during the evaluation aborts it between batches, so the checkpoint is
                # written within the grace period (one answer for all ranks; in a distributed run a flag
                # all-reduce and a host sync per batch: the evaluation is not the steady state).
                if self._stop is not None and stop_reached_any_rank(self._stop, self.topo, self.device):
                    self.model.train()
                    return None
                losses[name].append(self.evaluate_batch(batch))
        # The losses stay on the device until one read for all sets (a float() per batch would sync each).
        values = torch.stack([loss.float() for ls in losses.values() for loss in ls]).tolist() if losses else []
        i = 0
        for name, ls in losses.items():
            mine, i = values[i : i + len(ls)], i + len(ls)
            key = "val_loss" if name == "valid" else f"val_loss_{name}"
            out[key] = sum(mine) / len(mine)
        self.model.train()
        if "val_loss" in out:
            out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
        return out

    # --- loop -----------------------------------------------------------------------
    def fit(self, callbacks: list[Any] | None = None) -> dict[str, float]:
        """Train from ``self.step`` to ``max_steps``; returns the last evaluation.

        Every ``log_interval`` steps rank 0 prints one line (``telemetry.logger.step_line``),
        whatever the progress bar does. Step outcomes are read on the host only at log, eval and
        save steps and the last step (``step_guard.StepLedger``); skipped steps are logged and the
        guards' stops raised there, before any checkpoint. Each step's stop and post-step guard
        flags also reach the host one step later (``step_guard.LaggedFlags``): a refused update is
        raised after the next step, not at the next read step. SIGTERM/SIGUSR1
        (``training.preemption``) make every rank stop at a step boundary (the next one in a single
        process; in a distributed run the one after the next step at the latest, the flag
        travelling in each step's all-reduce), save a checkpoint and raise ``TrainingPreempted``."""
        t = self.cfg.training
        callbacks = list(callbacks or [])
        profiler = StepProfiler(t.profile_steps, self.run_dir, self.topo.rank, self.logger.info) \
            if t.profile_steps else None
        if profiler is not None:  # first, so that the other callbacks' work at those steps is in the trace
            callbacks.insert(0, profiler)
        tokens_per_step = t.global_batch_size * t.seq_len
        if self.step == 0:
            self.logger.info(f"model: {self.grads.global_numel() / 1e6:.2f}M parameters, vocab {self.vocab_size}, "
                             f"{self.topo.describe()}, device {self.device}, autocast {self.autocast_dtype}, "
                             f"plan {self.plan.policy} (FP4 share {self.plan.fp4_flops_share:.2f})")
        window, ledger, lagged = LogWindow(), StepLedger(), LaggedFlags(self.device)
        fit_start, first_step = time.perf_counter(), self.step
        last_eval: dict[str, float] = {}
        last_loss = math.nan
        with StopSignal(t.preempt_grace_s, lambda: describe_last_checkpoint(self.ckpt_root)) as stop, \
                AsyncCheckpointer.on_exit(self.saver), StepProfiler.on_exit(profiler):
            self._stop = stop
            while self.step < t.max_steps:
                step = self.step
                stop.set_phase("boundary", step, "a re-plan or callback before the next step")
                for cb in callbacks:
                    cb.before_step(self, step)
                stop.set_phase("step", step + 1)
                t0 = time.perf_counter()
                res = self.train_step(step)
                for line in fallbacks.drain():  # a faster quantizer/GEMM path fell back: say so once
                    self.logger.info(line)
                self.step = step + 1
                ledger.add(res, time.perf_counter() - t0, fp4_share=self.plan.fp4_flops_share)
                late = lagged.exchange(res)  # the step before's stop and guard flags, read without a sync
                logged = self.step % t.log_interval == 0 or self.step == t.max_steps
                evaluated = self.step % t.eval_interval == 0 or self.step == t.max_steps
                saved = bool(t.save_interval and self.step % t.save_interval == 0) or self.step == t.max_steps
                refused = late is not None and late.refused  # the read raises it (step_guard.ruinous_update_stop)
                records = self._settle(ledger, window, t0) if logged or evaluated or saved or refused else []
                metrics: dict[str, Any] = {}
                if records and (logged or records[-1].skipped):
                    metrics.update(self._step_metrics(records[-1]))
                if logged:
                    rec = records[-1]
                    last_loss = rec.loss
                    elapsed = time.perf_counter() - fit_start
                    per_step = elapsed / (self.step - first_step)
                    self.logger.info(step_line(
                        self.step, t.max_steps, loss=window.mean_loss(), lr=lr_at(step, t), grad_norm=rec.grad_norm,
                        tokens_per_s=tokens_per_step * window.steps / window.seconds,
                        tflops_per_rank=self.throughput.flops_per_device * window.steps / window.seconds / 1e12,
                        peak_memory=peak_memory_text(self.device), skipped=self.skipped_steps,
                        fp4_share=self.plan.fp4_flops_share, elapsed_s=elapsed,
                        eta_s=per_step * (t.max_steps - self.step)))
                    window = LogWindow()
                stop.set_phase("boundary", self.step, "logging")
                # A stop already requested skips this boundary's evaluation, and one arriving during it
                # aborts it: the checkpoint comes first (a grace period never costs it).
                stopping, eval_note = self._stop_requested(stop, records, late), ""
                if evaluated and stopping:
                    eval_note = "; its evaluation was skipped to save first"
                elif evaluated:
                    stop.set_phase("boundary", self.step, "its evaluation")
                    result = self.evaluate()
                    if result is None:
                        stopping, eval_note = True, "; its evaluation was aborted (the signal came during it) to save first"
                    else:
                        last_eval = result
                        metrics.update(last_eval)
                        self.logger.info(f"step {self.step}: " + " ".join(f"{k}={v:.4f}" for k, v in last_eval.items()))
                if metrics:
                    self.logger.log_metrics(self.step, metrics)
                self.logger.progress(self.step, loss=last_loss, tok_s=int(tokens_per_step / (time.perf_counter() - t0)))
                if saved:
                    self.save(final=self.step == t.max_steps)
                elif self.saver is not None:  # commit a finished background write (agreed at read steps)
                    self.saver.poll(read_step=logged or evaluated)
                stop.set_phase("boundary", self.step, "a callback after the step")
                for cb in callbacks:
                    cb.after_step(self, step)
                if stopping or self._stop_requested(stop, records, late):
                    if saved and self.saver is not None:
                        self.saver.finish()  # a preemption waits for the checkpoint it reports
                    if not saved:
                        unread = self._settle(ledger, window, t0)  # the guards speak before the checkpoint
                        if unread and unread[-1].skipped:
                            self.logger.log_metrics(self.step, self._step_metrics(unread[-1]))
                        self.save(final=True)
                    # Steps counted as the log counts them (from 1): checkpoint step_N holds N steps.
                    raise TrainingPreempted(
                        f"received {stop.received.name if stop.received else 'a stop signal (on another rank)'}; "
                        f"stopped after step {self.step}: checkpoint {ckpt.step_dir(self.ckpt_root, self.step)} "
                        f"written{eval_note}; resume with training.resume=auto (the launchers' default)")
            self._stop = None
        return last_eval

    def _settle(self, ledger: StepLedger, window: LogWindow, t0: float) -> list[StepRecord]:
        """Read the steps since the last read (one host sync) and account for them in order: count
        skips, log each skipped step (text and metrics line, as its own step), and raise
        ``TrainingStopped`` at a run of ``max_consecutive_skips`` non-finite steps or a ruinous
        update. The last step's wall time runs to after the read (``t0``: its start)."""
        t = self.cfg.training
        records = ledger.read()
        if records:
            records[-1].dt = time.perf_counter() - t0
        for rec in records:
            window.add(rec)
            if rec.skipped:
                self.skipped_steps += 1
                self.consecutive_skips += 1
                self.logger.info(f"step {rec.step}: non-finite loss={rec.loss} grad_norm={rec.grad_norm}; step "
                                 f"skipped ({self.consecutive_skips} in a row, {self.skipped_steps} total)")
                if self.consecutive_skips >= t.max_consecutive_skips:
                    raise non_finite_stop(self.consecutive_skips, t.max_consecutive_skips, rec.step)
                if rec.step + 1 != self.step:  # the current step's line is the caller's (with its evaluation)
                    self.logger.log_metrics(rec.step + 1, self._step_metrics(rec))
            else:
                self.consecutive_skips = 0
            if rec.bad_update:
                last = ckpt.latest_checkpoint(self.ckpt_root)
                where = f"the last checkpoint (step {last}, {ckpt.step_dir(self.ckpt_root, last)})" \
                    if last is not None else "no checkpoint (none was saved yet)"
                raise ruinous_update_stop(rec, t.max_param_norm_growth, t.lr, where)
        return records

    def _step_metrics(self, rec: StepRecord) -> dict[str, Any]:
        """The metrics.jsonl fields of one step (logged at log steps and for every skipped step)."""
        t = self.cfg.training
        return {"loss": rec.loss, "lr": lr_at(rec.step, t), "grad_norm": rec.grad_norm, "step_time_s": rec.dt,
                "tokens_per_s": t.global_batch_size * t.seq_len / rec.dt, "skipped_steps": self.skipped_steps,
                "fp4_share": rec.host["fp4_share"], **self.throughput.metrics(rec.dt)}

    def _stop_requested(self, stop: StopSignal, records: list[StepRecord], late: LateFlags | None) -> bool:
        """Whether any rank received a preemption signal (one decision for all ranks): in a single
        process the handler's own flag, at once; in a distributed run the flag each step reduced
        with its skip flag, read a step later (``late``) or at a read step (``records``)."""
        if not self.topo.is_distributed:
            return stop.received is not None
        return any(rec.stop for rec in records) or (late is not None and late.stop)

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "quant_generator": self.quant_generator.get_state(),
            "plan": self.plan.to_json_dict(),
            **self.recorder.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved (this rank's checkpoint shard)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state["consecutive_skips"]
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        self.quant_generator.set_state(state["quant_generator"])
        self.plan = PrecisionPlan.from_json_dict(state["plan"])
        self.recorder.load_state_dict(state)
        self._param_norm = self.param_norm()

    def save(self, final: bool = True) -> None:
        """Checkpoint after ``self.step`` (``RunDirectory.save``: every rank's shard, then rank 0's
        commit). ``meta.json`` records the resolved config (compared on resume), the vocabulary
        size and how many bytes of ``metrics.jsonl`` belong to the run up to this step. With
        ``training.async_save`` a periodic save (``final=False``) is written in the background
        (``AsyncCheckpointer``); a final one (the last step's, a preemption's, a caller's) first
        waits for the write in flight, then writes synchronously."""
        if self._stop is not None:  # a forced stop from here on says a save was cut short
            self._stop.set_phase("save", self.step)
        state = self.state_dict()  # on every rank: the distributed optimizer gathers its DP shards here
        meta = None
        if self.is_writer:
            meta = {"step": self.step, "tp": self.topo.tp, "pp": self.topo.pp, "dp": self.topo.dp,
                    "sequence_parallel": self.tp.sequence_parallel, "plan_hash": self.plan.hash, "time": time.time(),
                    "vocab_size": self.vocab_size, "config": self.cfg.to_dict(),
                    "metrics_bytes": self.logger.metrics_bytes()}
        if self.saver is not None and not final:
            self.saver.start(self.step, state, self.model.layer_ids, meta)
            return
        if self.saver is not None:
            self.saver.finish()
        self.run_directory.save(self.step, state, self.model.layer_ids, meta)

    def load_latest(self) -> bool:
        """Restore the newest checkpoint that verifies (``training.resume``; ``RunDirectory.latest``
        chooses and checks it); True if one was loaded."""
        restored = self.run_directory.latest(self.logger, self.vocab_size, self.model.layer_ids)
        if restored is None:
            return False
        self.load_state_dict(restored.state)
        if "metrics_bytes" in restored.meta:  # drop records logged after this checkpoint (they will be logged again)
            self.logger.truncate_metrics(restored.meta["metrics_bytes"])
        self.logger.info(f"resumed from step {self.step} ({restored.path}), plan {self.plan.policy} hash {self.plan.hash}")
        return True
