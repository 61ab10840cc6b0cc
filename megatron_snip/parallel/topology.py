"""Process topology: TP x PP x DP = world size, Megatron rank order (TP fastest, then DP, then PP).

    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

A ``ParallelTopology`` holds this rank's coordinates and its process groups; it is passed
explicitly to whoever communicates (no module-level globals). ``ParallelTopology.single()``
is the trivial 1x1x1 topology of a single process (all groups None).

``group_ranks(world_size, tp, pp)`` lists the rank sets of every group (pure, testable);
``parallel/distributed.py`` turns them into process groups. TP groups are consecutive ranks
(one node's NVLink domain when tp <= GPUs per node), DP groups stride by ``tp``, PP groups
stride by ``tp * dp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP_KINDS: tuple[str, ...] = ("tp", "pp", "dp", "mp")


def check_layout(world_size: int, tp: int, pp: int) -> int:
    """Validate a TP x PP layout for ``world_size`` ranks; returns the data-parallel size.

    Raises ValueError naming the field, its value and the fix.
    """
    if world_size < 1:
        raise ValueError(f"world size {world_size} must be >= 1 (torchrun's WORLD_SIZE)")
    if tp < 1 or pp < 1:
        raise ValueError(f"config parallel.tp={tp} / parallel.pp={pp}: both must be >= 1")
    if world_size % (tp * pp):
        raise ValueError(f"config parallel.tp*parallel.pp={tp * pp} (tp={tp}, pp={pp}) must divide the world size "
                         f"{world_size}; launch a multiple of {tp * pp} ranks or change tp/pp")
    return world_size // (tp * pp)


def group_ranks(world_size: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Global ranks of every group of each kind, in Megatron order.

    Returns {"tp": [...], "pp": [...], "dp": [...], "mp": [...]}; each value lists disjoint
    rank lists covering the world. ``mp`` (model parallel) = all TP x PP ranks of one DP replica.
    """
    dp = check_layout(world_size, tp, pp)
    rank_of = ParallelTopology.rank_of
    return {
        "tp": [[rank_of(t, p, d, tp, dp) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "pp": [[rank_of(t, p, d, tp, dp) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[rank_of(t, p, d, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "mp": [sorted(rank_of(t, p, d, tp, dp) for p in range(pp) for t in range(tp)) for d in range(dp)],
    }


def layers_of_stage(num_layers: int, pp: int, stage: int) -> range:
    """Global block indices of pipeline stage ``stage`` of ``pp``: the even split, the one home of it.

    Raises ValueError (naming the config fields) when ``num_layers`` is not a multiple of ``pp``.
    """
    if num_layers % pp:
        raise ValueError(f"config model.num_layers={num_layers} must be divisible by parallel.pp={pp} "
                         f"(even layer split)")
    assert 0 <= stage < pp, f"stage {stage} outside a {pp}-stage pipeline"
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_of_layer(num_layers: int, pp: int) -> dict[int, int] | None:
    """Global block index -> pipeline stage for ``layers_of_stage``'s split; None with one stage
    (no per-stage constraints to state)."""
    if pp <= 1:
        return None
    return {layer: stage for stage in range(pp) for layer in layers_of_stage(num_layers, pp, stage)}


@dataclass(frozen=True)
class TensorParallel:
    """What a tensor-parallel layer needs to know: its TP group, size, rank and whether
    activations between TP regions are sharded along the sequence (sequence parallelism).

    ``TensorParallel()`` is the unsharded default (size 1, no group).
    """

    group: Any = None
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel(size={self.size}, rank={self.rank}): need size >= 1 and 0 <= rank < size")
        if self.sequence_parallel and self.size == 1:
            raise ValueError("config parallel.sequence_parallel=true needs parallel.tp > 1 (or set it to false)")


@dataclass(frozen=True)
class ParallelTopology:
    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any = None  # ProcessGroup of the ranks sharing this (pp, dp) coordinate
    pp_group: Any = None  # ranks sharing (tp, dp): the pipeline this rank belongs to
    dp_group: Any = None  # ranks sharing (tp, pp): data-parallel replicas of this shard
    mp_group: Any = None  # ranks sharing dp: one whole model replica (TP x PP), for global norms
    world_group: Any = None  # all ranks (None: no group, a single process - as for every group here)
    # The device of this rank's tensors in collectives: "cuda:<i>" on NCCL (init_distributed binds
    # every group to it), "cpu" on gloo. Build tensors for comm helpers on it, never on a default.
    device: str = "cpu"

    @classmethod
    def single(cls) -> ParallelTopology:
        return cls(world_size=1, rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0)

    @classmethod
    def from_rank(cls, world_size: int, rank: int, tp: int, pp: int, **groups: Any) -> ParallelTopology:
        """Coordinates of ``rank`` in a ``world_size`` = tp x pp x dp layout (groups passed as keywords)."""
        dp = check_layout(world_size, tp, pp)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks (torchrun's RANK)")
        tp_rank, pp_rank, dp_rank = cls.coords(rank, tp, pp, dp)
        return cls(world_size, rank, tp, pp, dp, tp_rank, pp_rank, dp_rank, **groups)

    @staticmethod
    def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank."""
        return rank % tp, rank // (tp * dp), (rank // tp) % dp

    @staticmethod
    def rank_of(tp_rank: int, pp_rank: int, dp_rank: int, tp: int, dp: int) -> int:
        return tp_rank + tp * (dp_rank + dp * pp_rank)

    def tensor_parallel(self, sequence_parallel: bool = False) -> TensorParallel:
        """This rank's TP view for building tensor-parallel layers."""
        return TensorParallel(self.tp_group, self.tp, self.tp_rank, sequence_parallel)

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of this rank's peer (same tp_rank, dp_rank) on pipeline stage ``pp_rank``."""
        return self.rank_of(self.tp_rank, pp_rank, self.dp_rank, self.tp, self.dp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def stage_layers(self, num_layers: int, pp_rank: int | None = None) -> range:
        """Global block indices held by pipeline stage ``pp_rank`` (default: this rank's stage)."""
        return layers_of_stage(num_layers, self.pp, self.pp_rank if pp_rank is None else pp_rank)

    def describe(self) -> str:
        return (f"world={self.world_size} tp={self.tp} pp={self.pp} dp={self.dp} | rank {self.rank}: "
                f"tp_rank={self.tp_rank} pp_rank={self.pp_rank} dp_rank={self.dp_rank}")
