"""Process topology: TP x PP x DP = world size, Megatron rank order (TP fastest, then DP, then PP).

    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

A ``ParallelTopology`` holds this rank's coordinates and its process groups; it is passed
explicitly to whoever communicates (no module-level globals). ``ParallelTopology.single()``
is the trivial 1x1x1 topology of a single process (all groups None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @classmethod
    def single(cls) -> ParallelTopology:
        return cls(world_size=1, rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0)

    @staticmethod
    def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank."""
        return rank % tp, rank // (tp * dp), (rank // tp) % dp

    @staticmethod
    def rank_of(tp_rank: int, pp_rank: int, dp_rank: int, tp: int, dp: int) -> int:
        return tp_rank + tp * (dp_rank + dp * pp_rank)

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
        """Global block indices held by pipeline stage ``pp_rank`` (even split)."""
        r = self.pp_rank if pp_rank is None else pp_rank
        per = num_layers // self.pp
        return range(r * per, (r + 1) * per)

    def describe(self) -> str:
        return (f"world={self.world_size} tp={self.tp} pp={self.pp} dp={self.dp} | rank {self.rank}: "
                f"tp_rank={self.tp_rank} pp_rank={self.pp_rank} dp_rank={self.dp_rank}")
