"""The ``[snip]`` section: when and how SNIP re-plans, its statistics' options and its targets.

``SnipConfig`` checks each of its fields in ``__post_init__``; the checks against other sections
(``snip.budget = "run"`` against the schedule, the pipeline's stages) are ``Config.validate``'s, in
``sections.py``. The tuples name each enumerated field's choices (the one list of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_snip.config.values import check_finite, check_positive, check_seed, field_error, parse_time_costs
from megatron_snip.precision.plan import GRANULARITIES

CURVATURE_NOISE = ("gaussian", "error")  # snip.curvature_noise: directions of SNIP's forward noise
LOSS_FIRST_ORDER = ("abs", "signed", "momentum")  # snip.loss_first_order: the loss divergence's first-order term
WEIGHT_DIVERGENCE = ("norm", "squared", "loss")  # snip.weight_divergence: how the weight divergence measures an update error
PRECONDITIONERS = ("stored", "with_probe")  # snip.preconditioner: the AdamW second moment the statistics divide by
SNIP_TARGETS = ("fp4_share", "gemm_time", "both")  # snip.target
SNIP_BUDGETS = ("plan", "run")  # snip.budget


@dataclass(frozen=True)
class SnipConfig:
    """Adaptive precision: when and how to re-plan (see docs/snip.md)."""

    enabled: bool = False
    # "snip", a baseline (uniform:<f>, bf16_ends:<a>,<b>, tail[:<n>], attn_protected, mlp_only, layer_type,
    # min_rel_err, random) or the "truth" oracle
    policy: str = "snip"
    fp4_target: float = 0.75  # minimum share of linear-layer FLOPs in an FP4 format
    formats: tuple[str, ...] = ("fp8", "nvfp4")  # candidate formats per decision unit
    # "gemm": each GEMM (fprop, dgrad, wgrad) decided alone; "layer": one format per linear (its 3 GEMMs
    # tied), which precision.backend="te" needs (one recipe per linear). "gemm" is the default since it
    # won on the reported seeds at equal FP4 share and GEMM time (docs/results/run_budget/gemm_results.md).
    granularity: str = "gemm"
    warmup: int = 10  # first re-plan at this step
    interval: int = 20  # then every `interval` steps
    probe_batches: int = 2  # micro-batches the statistics are averaged over
    # Sequences per probe micro-batch; 0 = training.micro_batch_size. Smaller is cheaper and noisier
    # (docs/snip.md, "Probe size": on tiny, 1 sequence re-plans in 1.6 steps but plans worse).
    probe_micro_batch_size: int = 0
    weight_divergence_weight: float = 1.0  # lambda in sum(dL + lambda * dW)
    # lambda times the mean of lr / lr_peak over the steps the plan will be in force (until the next
    # re-plan): a weight error enters the loss through the update, which the LR scales, while an fprop
    # error does not, so in the LR decay dW counts for less (docs/snip.md, "LR-scaled weight
    # divergence"). Off by default: no recorded result used it.
    weight_divergence_lr_scaled: bool = False
    noise_draws: int = 2  # forward-noise passes per probe batch (curvature, one-sided vs the reference pass)
    # Direction of the forward noise: "gaussian" (isotropic: mean curvature along Y) or "error" (±the
    # harshest format's own e_Y: curvature along the error priced). docs/snip.md, "Forward-noise pass".
    # The default and every shipped config stay on "gaussian": "error" ranked the curvature part better
    # on two development seeds (docs/results/validation/loss_divergence/summary.md) but has no training win
    # yet, and switching would change SNIP's plans and void the recorded comparisons
    # (comparison.protocol.same_config). Opt in with --set snip.curvature_noise=error.
    curvature_noise: str = "gaussian"
    # The loss divergence's first-order term: "abs" (mean per-batch |<G, e_Y>|), "signed" (mean <G, e_Y>,
    # a systematic gain counts), "momentum" (signed, the weight error's part from AdamW's m̂). snip/metrics.py.
    loss_first_order: str = "abs"
    # The weight divergence of a GEMM: "norm" (‖update error‖ / ‖update‖, the default and every recorded
    # result), "squared" (‖update error‖² / ‖update‖²: additive over GEMMs, as the ILP's sum assumes, and
    # what AdamW's steady-state excess loss from update noise scales with) or "loss" (the squares priced in
    # loss by the curvature of what each error moves: κ times the input's mean square for wgrad, the model's
    # mean of that for dgrad). snip/metrics.py, docs/snip.md.
    weight_divergence: str = "norm"
    # The √v̂ the statistics precondition gradients and their errors by: "stored" (AdamW's v̂ after the
    # last step: the default and every recorded result) or "with_probe" (the v̂ the next update divides
    # by, the probe gradient folded in as AdamW folds a step's gradient in first: bounded where one
    # probe gradient is far above v̂'s history). snip/adam_moments.py adam_denominator, docs/snip.md.
    preconditioner: str = "stored"
    # Memory of the costs across re-plans: a plan is solved from c_k = cost_ema * c_(k-1) + (1 - cost_ema)
    # * (this re-plan's costs), an exponential moving average over the re-plans (the first takes its
    # own; snip/cost_memory.py, docs/snip.md "Costs across re-plans"). 0, the default and every recorded
    # result: each plan follows its own probe batches only. In [0, 1).
    cost_ema: float = 0.0
    # Each forward GEMM's cost in the format it runs in under the plan in force is multiplied by
    # 1 - forward_stickiness when the next plan is solved: the weights adapt to the quantization error of
    # the forward GEMMs they train with, which the statistics cannot see (snip/cost_memory.py kept_forward,
    # docs/snip.md "Kept forward formats"). 0, the default and every recorded result: SNIP as measured;
    # 1: staying is free. In [0, 1].
    forward_stickiness: float = 0.0
    # Each forward GEMM's costs of block l are multiplied by ((l + 1/2) / L) ** p, normalized to mean 1
    # over the blocks, before a plan is solved: an FP4 forward GEMM costs less at evaluation the earlier
    # it sits, which the statistics cannot see (snip/priors.py, docs/snip.md "Depth prior on the forward
    # GEMMs"). 0, the default and every recorded result: no prior. p >= 0.
    forward_depth_prior: float = 0.0
    propagation_sequences: int = 1  # sequences of the first probe batch for the exact dgrad-propagation pass
    # Policy "truth" only (the oracle of snip/truth.py): training micro-batches its measured divergences
    # are averaged over, from the re-plan step's data on. Each costs 3 passes per linear and format.
    truth_batches: int = 8
    # The re-plan step's training step takes its gradient from the statistics' reference pass (BF16) for
    # those of its micro-batches that were probe batches, instead of running them again (docs/snip.md,
    # "Re-plan cost"). Off by default: the recorded comparisons ran without it (a step per re-plan in
    # BF16 would favour the policies that collect statistics); the shipped configs turn it on.
    reuse_step: bool = False
    solver_max_time: float = 10.0  # CP-SAT max_deterministic_time
    seed: int = 0
    # Static baselines (bf16_ends without counts, layer_type, random) land within one decision unit
    # above fp4_target, per pipeline stage, instead of wherever their rule puts them (layer_type's
    # rule alone gives 0.667 at 0.5): what a fair comparison at equal FP4 share needs.
    fair_share: bool = False
    # Efficiency target (docs/snip.md, "Targets"): "fp4_share" (at least fp4_target of the linear FLOPs
    # in an FP4 format), "gemm_time" (modeled linear-GEMM time at most time_budget x the same GEMMs in
    # BF16 on the target GPU; fp4_target is then not used) or "both". Every policy takes the same target.
    target: str = "fp4_share"
    time_budget: float = 1.0  # gemm_time: e.g. 0.6 = at most 60% of the BF16 GEMM time
    # Relative GEMM time per FLOP as "format=ratio" entries, e.g. ["bf16=1", "fp8=0.5"]; empty: from the
    # GPU the run runs on and precision.backend (precision/capability.py, GEMM_TIME_RATIO). Set it for
    # a device you measured, or to model a GPU from a CPU run.
    time_costs: tuple[str, ...] = ()
    # Where fp4_target must hold (docs/snip.md, "Run-level FP4 budget"): "plan" (every plan's FP4 share
    # >= fp4_target, the default and every recorded result) or "run" (the step-weighted FP4 share over
    # steps [warmup, training.max_steps) >= fp4_target; each re-plan chooses its interval's share from
    # the cost curve of its statistics and the LR schedule, snip/budget.py). "run" needs target="fp4_share".
    budget: str = "plan"
    # budget="run": the shares an interval may take, [low, high], on a grid of budget_share_step.
    budget_share_range: tuple[float, ...] = (0.5, 0.95)
    # budget="run": the grid step of the interval shares (each grid share is one ILP solve of SNIP's cost curve).
    budget_share_step: float = 0.05
    # budget="run": an interval's FP4 cost is weighted by the mean of (lr_peak / lr) ** p over its steps;
    # 0 weighs every interval alike (then the run budget plans the plan budget's share, for a convex cost).
    budget_lr_power: float = 1.0

    def __post_init__(self) -> None:
        check_finite("snip", self)
        self._check_budget()
        check_seed("snip.seed", self.seed)
        if self.target not in SNIP_TARGETS:
            raise field_error("snip.target", self.target, f"choose one of {list(SNIP_TARGETS)}")
        if not self.time_budget > 0:
            raise field_error("snip.time_budget", self.time_budget, "must be > 0 (a fraction of the BF16 GEMM time, e.g. 0.6)")
        parse_time_costs(self.time_costs)  # ValueError naming the field
        if not 0.0 <= self.fp4_target <= 1.0:
            raise field_error("snip.fp4_target", self.fp4_target, "must be a fraction in [0, 1] (e.g. 0.75)")
        if self.granularity not in GRANULARITIES:
            raise field_error("snip.granularity", self.granularity, f"choose one of {list(GRANULARITIES)}")
        if self.curvature_noise not in CURVATURE_NOISE:
            raise field_error("snip.curvature_noise", self.curvature_noise, f"choose one of {list(CURVATURE_NOISE)}")
        if self.loss_first_order not in LOSS_FIRST_ORDER:
            raise field_error("snip.loss_first_order", self.loss_first_order, f"choose one of {list(LOSS_FIRST_ORDER)}")
        if self.weight_divergence not in WEIGHT_DIVERGENCE:
            raise field_error("snip.weight_divergence", self.weight_divergence, f"choose one of {list(WEIGHT_DIVERGENCE)}")
        if self.preconditioner not in PRECONDITIONERS:
            raise field_error("snip.preconditioner", self.preconditioner, f"choose one of {list(PRECONDITIONERS)}")
        if not 0.0 <= self.cost_ema < 1.0:
            raise field_error("snip.cost_ema", self.cost_ema,
                              "must be in [0, 1): the previous re-plans' weight in a plan's costs (0 = off, e.g. 0.5)")
        if not 0.0 <= self.forward_stickiness <= 1.0:
            raise field_error("snip.forward_stickiness", self.forward_stickiness,
                              "must be in [0, 1]: the discount on a forward GEMM keeping its format (0 = off, 1 = free)")
        if not self.forward_depth_prior >= 0:
            raise field_error("snip.forward_depth_prior", self.forward_depth_prior,
                              "must be >= 0: the power of the depth ramp on forward GEMM costs (0 = off, e.g. 1)")
        if self.warmup < 0:
            raise field_error("snip.warmup", self.warmup, "must be >= 0")
        if self.probe_micro_batch_size < 0:
            raise field_error("snip.probe_micro_batch_size", self.probe_micro_batch_size,
                       "must be >= 0 (sequences per probe micro-batch; 0 = training.micro_batch_size)")
        check_positive("snip", self, "interval", "probe_batches", "noise_draws", "propagation_sequences", "truth_batches",
                       "solver_max_time")
        if self.weight_divergence_weight < 0:
            raise field_error("snip.weight_divergence_weight", self.weight_divergence_weight, "must be >= 0")
        if not self.formats:
            raise field_error("snip.formats", self.formats, "list at least one candidate format, e.g. ['fp8', 'nvfp4']")
        from megatron_snip.precision.formats import FORMATS

        for f in self.formats:
            if f not in FORMATS:
                raise field_error("snip.formats", list(self.formats), f"{f!r} is not a format; choose from {sorted(FORMATS)}")

    def _check_budget(self) -> None:
        if self.budget not in SNIP_BUDGETS:
            raise field_error("snip.budget", self.budget, f"choose one of {list(SNIP_BUDGETS)}")
        rng = self.budget_share_range
        if (len(rng) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                     for x in rng) or not 0 <= rng[0] <= rng[1] <= 1):
            raise field_error("snip.budget_share_range", list(rng),
                              "give [low, high] FP4 shares with 0 <= low <= high <= 1, e.g. [0.5, 0.95]")
        if not self.budget_share_step > 0:
            raise field_error("snip.budget_share_step", self.budget_share_step, "must be > 0 (e.g. 0.05)")
        if not self.budget_lr_power >= 0:
            raise field_error("snip.budget_lr_power", self.budget_lr_power, "must be >= 0 (0: every interval alike)")
        if self.budget != "run":
            return
        if self.target != "fp4_share":
            raise field_error("snip.budget", self.budget, f"a run-level budget spends an FP4 share; it needs "
                              f"snip.target=\"fp4_share\" (got snip.target={self.target!r}) or snip.budget=\"plan\"")
        if not rng[0] <= self.fp4_target <= rng[1]:
            raise field_error("snip.budget_share_range", list(rng),
                              f"must contain snip.fp4_target={self.fp4_target} (the run's share is a mean of the "
                              f"intervals' shares); widen the range or change the target")
