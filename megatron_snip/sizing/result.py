"""The dry run's results: what ``sizing.estimate`` returns (``Sizing`` and its parts), as plain data.

Both halves of the dry run read these - ``dry_run.py`` builds them, ``gemm_time.py`` renders the
GEMM-time lines from one - so they live apart from both and import neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.precision.capability import GpuSpec
from megatron_snip.precision.plan import LINEARS

WEIGHT_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8  # fp32 master weight, fp32 grad, fp32 m + v


@dataclass(frozen=True)
class StageSizing:
    """One pipeline stage, per rank (its TP shard).

    Attributes:
        stage: pipeline rank.
        first_layer, last_layer: global block indices held (inclusive).
        params: parameters held by one rank of this stage.
        in_flight: micro-batches whose activations the stage holds at peak.
        activation_bytes: saved activations at peak (all in-flight micro-batches, plus the
            LM head's on the last stage).
        flops: FLOPs one rank of this stage computes per step (its share of the global batch).
    """

    stage: int
    first_layer: int
    last_layer: int
    params: int
    in_flight: int
    activation_bytes: int
    flops: int
    optimizer_shards: int = 1  # dp with the distributed optimizer, else 1


    @property
    def weight_bytes(self) -> int:
        return WEIGHT_BYTES * self.params

    @property
    def grad_bytes(self) -> int:
        return GRAD_BYTES * self.params

    @property
    def optimizer_bytes(self) -> int:
        return -(-ADAM_BYTES * self.params // self.optimizer_shards)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class SnipSizing:
    """Size of the SNIP decision problem.

    Attributes:
        enabled: ``snip.enabled``.
        granularity: "layer" (4 units per block) or "gemm" (12 per block).
        formats: candidate formats.
        units: decision units.
        allowed: format -> number of units it is allowed on (block divisibility).
        booleans: ILP Boolean variables (sum of ``allowed``).
        exactly_one, fp4_floors: constraints: one per unit; global + per-stage FP4 floors.
        max_fp4_share: the largest FP4 FLOP share the divisibility rules leave reachable.
        time_caps: GEMM-time constraints (global + per stage) under a time target, else 0.
        unit_kinds: per kind of unit (the same in every block): (FLOP weight K*N summed over its
            GEMMs, the candidates its shapes allow).
        unit_names: the same kinds' (linear, its GEMMs), in the same order.
    """

    enabled: bool
    granularity: str
    formats: tuple[str, ...]
    units: int
    allowed: dict[str, int]
    booleans: int
    exactly_one: int
    fp4_floors: int
    max_fp4_share: float
    time_caps: int = 0
    unit_kinds: tuple[tuple[int, tuple[str, ...]], ...] = ()
    unit_names: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def constraints(self) -> int:
        return self.exactly_one + self.fp4_floors + self.time_caps


@dataclass(frozen=True)
class Sizing:
    """Everything the dry run reports; see the module docstring for the formulas.

    ``flops`` maps "qkv.fprop" ... "fc2.wgrad" (all blocks), "attention.fwd",
    "attention.bwd", "lm_head.fprop|dgrad|wgrad" to FLOPs per step on the global batch.
    """

    world_size: int
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    schedule: str
    vocab_size: int
    vocab_source: str
    layers_per_stage: int
    params_total: int
    params_embedding: int
    params_blocks: int
    params_head: int  # final norm + LM head
    micro_batch: int
    seq_len: int
    global_batch: int
    micro_batches: int  # per DP rank per step
    tokens_per_step: int
    activation_element_bytes: int
    activation_bytes_per_token_layer: int  # per rank, after TP/SP sharding, of a block not fully recomputed
    activations: ActivationBytes
    stages: tuple[StageSizing, ...]
    flops: dict[str, int]
    snip: SnipSizing
    gpu: GpuSpec
    backend: str
    formats_used: tuple[str, ...]
    support: dict[str, tuple[bool, str]]

    @property
    def flops_total(self) -> int:
        return sum(self.flops.values())

    @property
    def flops_linear(self) -> int:
        return sum(v for k, v in self.flops.items() if k.split(".")[0] in LINEARS)

    @property
    def peak_stage(self) -> StageSizing:
        return max(self.stages, key=lambda s: s.total_bytes)

    @property
    def pipeline_bubble(self) -> float:
        """1F1B/GPipe idle fraction (pp - 1) / (m + pp - 1)."""
        return (self.pp - 1) / (self.micro_batches + self.pp - 1)


@dataclass(frozen=True)
class ActivationBytes:
    """What one rank's blocks save for backward, as the code saves it (module docstring, "Activations").

    Attributes:
        stored: bytes per token of a block that is not fully recomputed (selective recompute applied).
        recomputed: bytes per token of a fully recomputed block (its fp32 input, kept by the checkpoint).
        weight_copies_per_block: bytes of a stored block's autocast BF16 copies of the weights of
            linears on the reference (all-BF16) path, saved for their backward: held once per step,
            shared by every micro-batch in flight (precision/weight_copies.py).
        mode, every: ``training.recompute`` and ``training.recompute_every``.
    """

    stored: int
    recomputed: int
    weight_copies_per_block: int
    mode: str
    every: int

    @property
    def per_token_block(self) -> int:
        """Bytes per token of a block under ``mode`` (with "full": a recomputed one)."""
        return self.recomputed if self.mode == "full" else self.stored

    def recomputed_blocks(self, blocks: int) -> int:
        """How many of a stage's ``blocks`` are fully recomputed (local positions 0, every, 2*every, ...)."""
        return -(-blocks // self.every) if self.mode == "full" else 0

    def stage_bytes(self, blocks: int, tokens: int) -> int:
        """Saved bytes of ``blocks`` blocks for one micro-batch of ``tokens`` tokens (weight copies apart)."""
        rec = self.recomputed_blocks(blocks)
        return (rec * self.recomputed + (blocks - rec) * self.stored) * tokens

    def copy_bytes(self, blocks: int) -> int:
        """The step's weight copies of ``blocks`` blocks (none in fully recomputed ones)."""
        return (blocks - self.recomputed_blocks(blocks)) * self.weight_copies_per_block
