"""Gradient reduction and global-norm clipping for TP x PP x DP.

Choice: without the distributed optimizer, gradients are reduced by a bucketed all-reduce
*after* backward (not torch DDP's hooks). That works unchanged with the pipeline schedule's
many backward calls per step and with SNIP probe passes (which must not touch other
replicas' gradients), and gives the same result on gloo and NCCL. The distributed optimizer's
reduce-scatter can overlap backward (below); the all-reduce path does not (yet).

``ShardedGradReducer`` is the distributed optimizer's variant (ZeRO-1,
``training.distributed_optimizer``): step 2 becomes a bucketed reduce-scatter, so each DP
rank ends with the averaged gradient of only its shard, and the norm of step 3 sums the
shards over DP; ``all_gather_params`` brings the updated shards back to every replica.

Its overlap (``training.overlap_grad_reduce``), as torch DDP's reducer does it: a
post-accumulate-grad hook on every parameter counts the backward passes of the step
(``start_step(m)`` arms it for m micro-batches; SNIP's probe passes run unarmed); once a
parameter has its m-th gradient it is final, and once every parameter of a bucket is final
the bucket's reduce-scatter starts asynchronously while backward goes on. Buckets start in
one fixed order on every DP rank (descending index, about the order backward finishes them,
as DDP buckets in reverse parameter order) so the collectives line up; a bucket that is not
finished when its turn comes holds the later ones back until ``reduce``, which starts what is
left and waits. Buckets holding sequence-parallel parameters wait for ``reduce`` too (their
TP sum must come first, unchanged). Each reduce-scatter reduces the very bucket the
non-overlapped path would, so the shards are the same bits. At most two buckets are in
flight: their flat copies are the overlap's only extra memory.

Per step, after all micro-batches' backward:
  1. ``sequence_parallel`` params (norm weights under SP): grads summed over the TP group
     (each TP rank saw a different slice of the sequence).
  2. every grad averaged over the DP group (replicas saw different data).
  3. global grad norm over the whole model: sharded (``tensor_parallel``) params counted on
     every TP rank, replicated ones once (TP rank 0), summed over the model-parallel group
     (TP x PP); after step 2 DP replicas hold identical grads, so no DP sum.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_snip.parallel import comm
from megatron_snip.parallel.topology import ParallelTopology


def counted_once(tensor_parallel: bool, topo: ParallelTopology) -> bool:
    """Whether this rank counts a tensor in a whole-model sum (norm, parameter count): a TP-sharded
    tensor on every TP rank (each holds a different shard), a replicated one on TP rank 0 only."""
    return tensor_parallel or topo.tp_rank == 0


def global_norm(tensors: list[torch.Tensor], device: torch.device, *groups: object) -> torch.Tensor:
    """sqrt(Σ ‖t‖²) over ``tensors`` (an fp32 scalar on ``device``), the sum taken over each of
    ``groups`` in turn: the whole model's norm when every element is counted on one rank only."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if tensors:
        sq = torch.stack([n.float() for n in torch._foreach_norm(tensors, 2.0)]).pow(2).sum()
    for group in groups:
        comm.all_reduce_sum(sq, group)
    return sq.sqrt()


def clip_by_norm_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place so that ``norm`` becomes <= ``max_norm`` (torch.nn.utils.clip_grad_norm_'s
    rule: coef = max_norm / (norm + 1e-6), capped at 1; a non-finite norm makes every grad non-finite)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def _bucketed_all_reduce(grads: list[torch.Tensor], group: object, bucket_bytes: int, *, average: bool) -> None:
    """Sum (or average) ``grads`` in place over ``group``, a few flat buckets per dtype at a time."""
    n = comm.group_size(group)
    if n == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype_grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in dtype_grads + [None]:  # None flushes the last bucket
            if g is not None:
                bucket.append(g)
                size += g.numel() * g.element_size()
            if bucket and (g is None or size >= bucket_bytes):
                flat = _flatten_dense_tensors(bucket)
                comm.all_reduce_sum(flat, group)
                if average:
                    flat.div_(n)
                for g_old, g_new in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    g_old.copy_(g_new)
                bucket, size = [], 0


class GradReducer:
    """Reduces and clips the gradients of one rank's parameters (its TP shard of its PP stage).

    Args:
        params: this rank's parameters (``model.parameters()``), in the same order on every
            DP replica (true when replicas are built from the same config).
        topo: the topology (groups: tp for sequence-parallel grads, dp for averaging, mp for norms).
        bucket_mb: all-reduce bucket size.
    """

    def __init__(self, params: Iterable[nn.Parameter], topo: ParallelTopology, bucket_mb: float = 25.0) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.topo = topo
        self.bucket_bytes = int(bucket_mb * 2**20)

    def _reduce(self, params: list[nn.Parameter], group: object, *, average: bool) -> None:
        if comm.group_size(group) == 1 or not params:
            return
        # A parameter without a gradient contributes zeros, so every rank reduces the same buckets.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _bucketed_all_reduce([p.grad for p in params], group, self.bucket_bytes, average=average)

    def start_step(self, micro_batches: int) -> None:
        """Called before a step's ``micro_batches`` backward passes (the overlapped reducer counts them)."""

    def reduce(self) -> None:
        """Steps 1 and 2 of the module docstring (call once per optimizer step, after backward)."""
        sp = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        self._reduce(sp, self.topo.tp_group, average=False)
        self._reduce(self.params, self.topo.dp_group, average=True)

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient (fp32 scalar, the same on every rank of a replica)."""
        counted = [p.grad for p in self.params
                   if p.grad is not None and counted_once(getattr(p, "tensor_parallel", False), self.topo)]
        device = self.params[0].device if self.params else torch.device("cpu")
        return global_norm(counted, device, self.topo.mp_group)

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale grads so the global norm is <= ``max_norm`` (inf = no clipping); returns the norm before.

        A non-finite norm makes every grad non-finite, which the trainer's guard then skips."""
        norm = self.global_norm()
        clip_by_norm_([p.grad for p in self.params if p.grad is not None], norm, max_norm)
        return norm

    def global_numel(self) -> int:
        """Parameters of the whole model (each replicated tensor counted once)."""
        n = sum(p.numel() for p in self.params if counted_once(getattr(p, "tensor_parallel", False), self.topo))
        device = self.params[0].device if self.params else torch.device("cpu")  # NCCL needs device tensors
        return int(comm.all_reduce_sum(torch.tensor(float(n), dtype=torch.float64, device=device),
                                       self.topo.mp_group).item())


# --- ZeRO-1: buckets sharded over DP ---------------------------------------------------------
@dataclass
class ShardBucket:
    """Parameters reduced and updated together: one optimizer group, one dtype, TP-sharded or not.

    Flat layout: the params' elements in order (``offsets[i]`` = start of ``params[i]``), zero
    padded to ``shard_numel * dp``; DP rank r owns ``[r * shard_numel, (r + 1) * shard_numel)``.
    """

    params: list[nn.Parameter]
    group: int  # index of the optimizer param group
    offsets: list[int]
    numel: int  # elements before padding
    shard_numel: int
    tensor_parallel: bool  # params sharded over TP (their grads count in the norm on every TP rank)

    def owned(self, dp_rank: int) -> tuple[int, int]:
        """[start, end) of this rank's shard in the flat bucket."""
        return dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel

    def piece(self, i: int, dp_rank: int) -> tuple[int, int, int] | None:
        """(start in params[i].view(-1), start in the shard, length) of what rank ``dp_rank`` owns of params[i]."""
        lo, hi = self.owned(dp_rank)
        a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i] + self.params[i].numel())
        return (a - self.offsets[i], a - lo, b - a) if a < b else None

    def flatten(self, tensors: list[torch.Tensor | None], dp: int) -> torch.Tensor:
        """The padded flat bucket of one tensor per param (None = zeros), in the params' dtype."""
        p0 = self.params[0]
        flat = torch.zeros(self.shard_numel * dp, dtype=p0.dtype, device=p0.device)
        for t, off, p in zip(tensors, self.offsets, self.params):
            if t is not None:
                flat[off:off + p.numel()].copy_(t.reshape(-1))
        return flat


def shard_buckets(groups: list[list[nn.Parameter]], dp: int, bucket_bytes: int) -> list[ShardBucket]:
    """Split each group's params into buckets of about ``bucket_bytes`` (a param is never split
    across buckets), keyed by (group, dtype, TP-sharded). The same on every DP replica."""
    buckets: list[ShardBucket] = []
    for gi, params in enumerate(groups):
        by_key: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            by_key.setdefault((p.dtype, bool(getattr(p, "tensor_parallel", False))), []).append(p)
        for (_, tensor_parallel), ps in by_key.items():
            current: list[nn.Parameter] = []
            for p in ps + [None]:  # None flushes the last bucket
                if p is not None:
                    current.append(p)
                size = sum(q.numel() * q.element_size() for q in current)
                if current and (p is None or size >= bucket_bytes):
                    offsets = [0]
                    for q in current[:-1]:
                        offsets.append(offsets[-1] + q.numel())
                    numel = offsets[-1] + current[-1].numel()
                    buckets.append(ShardBucket(current, gi, offsets, numel, -(-numel // dp), tensor_parallel))
                    current = []
    return buckets


class ShardedGradReducer(GradReducer):
    """``GradReducer`` for the distributed optimizer: after ``reduce`` this rank holds, per bucket,
    the DP-averaged fp32 gradient of its shard (``grad_shards``); ``p.grad`` keeps the local,
    unreduced gradient (do not read it as the step's gradient).

    Args:
        groups: the optimizer's param groups' params (this rank's TP shard of its PP stage), in
            the same order on every DP replica.
        topo: tp group (sequence-parallel grads), dp group (the shards), mp group (norm).
        bucket_mb: bucket size.
        overlap: start each bucket's reduce-scatter during the step's last backward pass (module
            docstring); only where dp > 1.
    """

    MAX_IN_FLIGHT = 2  # overlapped buckets launched and not yet waited for (bounds their flat copies)

    def __init__(self, groups: list[list[nn.Parameter]], topo: ParallelTopology, bucket_mb: float = 25.0, *,
                 overlap: bool = False) -> None:
        super().__init__([p for g in groups for p in g], topo, bucket_mb)
        self.buckets = shard_buckets(groups, topo.dp, self.bucket_bytes)
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.overlap = overlap and topo.dp > 1
        # The order buckets start in, the same on every DP rank: backward finishes the last
        # parameters first; sequence-parallel buckets last (their TP sum runs in ``reduce``).
        sp = {i for i, b in enumerate(self.buckets)
              if topo.tp > 1 and any(getattr(p, "sequence_parallel", False) for p in b.params)}
        self._order = [i for i in reversed(range(len(self.buckets))) if i not in sp] + sorted(sp, reverse=True)
        self._hookable = len(self._order) - len(sp)  # the hooks may start _order[:_hookable]
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._armed_for = 0  # backward passes of the step being counted (0: hooks idle)
        self._accumulated: dict[int, int] = {}  # id(param) -> gradients accumulated this step
        self._finished = [0] * len(self.buckets)  # params of each bucket with their final gradient
        self._next = 0  # position in _order of the next bucket to start
        self._in_flight: list[tuple[int, object, torch.Tensor]] = []  # (bucket, work, flat input)
        self.launched_in_backward = 0  # buckets the hooks started during the last step (for tests, logs)
        if self.overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    # --- overlap ---------------------------------------------------------------------------------
    def start_step(self, micro_batches: int) -> None:
        """Arm the hooks for the ``micro_batches`` backward passes of one optimizer step."""
        if self.overlap:
            self._armed_for, self._accumulated = micro_batches, {}
            self._finished, self._next, self._in_flight = [0] * len(self.buckets), 0, []
            self.launched_in_backward = 0

    def _on_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: p's gradient of one backward pass is in ``p.grad``."""
        if not self._armed_for:
            return
        n = self._accumulated[id(p)] = self._accumulated.get(id(p), 0) + 1
        if n == self._armed_for:  # p's gradient is final for this step
            self._finished[self._bucket_of[id(p)]] += 1
            while self._next < self._hookable and self._ready(self._order[self._next]):
                self._launch(self._order[self._next])
                self._next += 1
                self.launched_in_backward += 1

    def _ready(self, i: int) -> bool:
        return self._finished[i] == len(self.buckets[i].params)

    def _launch(self, i: int) -> None:
        """Start bucket ``i``'s reduce-scatter over DP (waiting first if two are in flight)."""
        if len(self._in_flight) >= self.MAX_IN_FLIGHT:
            self._wait_oldest()
        b = self.buckets[i]
        flat = b.flatten([p.grad for p in b.params], self.topo.dp)
        shard, work = reduce_scatter_sum_async(flat, self.topo.dp_group)
        self.grad_shards[i] = shard
        self._in_flight.append((i, work, flat))

    def _wait_oldest(self) -> None:
        i, work, _ = self._in_flight.pop(0)  # the flat input is freed here
        work.wait()
        self.grad_shards[i].div_(self.topo.dp)

    # --- the step's reduction ----------------------------------------------------------------------
    def reduce(self) -> None:
        """SP grads summed over TP, then per bucket: reduce-scatter (sum) over DP and divide by dp
        (the same two operations as the all-reduce path, so at DP=2 the shards are bitwise its values).
        With overlap, buckets the hooks started are only waited for here."""
        sp = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        self._reduce(sp, self.topo.tp_group, average=False)
        dp = self.topo.dp
        if self.overlap:
            self._armed_for = 0
            for i in self._order[self._next:]:
                self._launch(i)
            self._next = len(self._order)
            while self._in_flight:
                self._wait_oldest()
            return
        for i, b in enumerate(self.buckets):
            flat = b.flatten([p.grad for p in b.params], dp)
            shard = reduce_scatter_sum(flat, self.topo.dp_group)
            self.grad_shards[i] = shard.div_(dp) if dp > 1 else shard

    def clear(self) -> None:
        self.grad_shards = [None] * len(self.buckets)

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient from the shards: summed over DP (each rank holds a
        different shard) and over TP x PP (replicated params counted on TP rank 0 only)."""
        counted = [g for b, g in zip(self.buckets, self.grad_shards)
                   if g is not None and counted_once(b.tensor_parallel, self.topo)]
        device = self.params[0].device if self.params else torch.device("cpu")
        return global_norm(counted, device, self.topo.dp_group, self.topo.mp_group)

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the grad shards so the global norm is <= ``max_norm``; rule as ``GradReducer.clip_``."""
        norm = self.global_norm()
        clip_by_norm_([g for g in self.grad_shards if g is not None], norm, max_norm)
        return norm

    def param_shard(self, i: int) -> torch.Tensor:
        """A flat copy of this rank's shard of bucket ``i``'s parameters (padding zeros)."""
        b = self.buckets[i]
        lo, hi = b.owned(self.topo.dp_rank)
        return b.flatten([p.detach() for p in b.params], self.topo.dp)[lo:hi].clone()

    @torch.no_grad()
    def all_gather_params(self, i: int, shard: torch.Tensor) -> None:
        """Every DP rank's updated ``shard`` of bucket ``i`` gathered into the parameters."""
        b = self.buckets[i]
        flat = all_gather_flat(shard, self.topo.dp_group)
        for p, off in zip(b.params, b.offsets):
            p.copy_(flat[off:off + p.numel()].view_as(p))


def reduce_scatter_sum(flat: torch.Tensor, group: object) -> torch.Tensor:
    """Sum ``flat`` (numel a multiple of the group size) over ``group``; returns this rank's
    contiguous 1/n of the sum (a new tensor; ``flat`` itself when the group has one rank)."""
    n = comm.group_size(group)
    if n == 1:
        return flat
    out = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=group)
    return out


def reduce_scatter_sum_async(flat: torch.Tensor, group: object) -> tuple[torch.Tensor, object]:
    """``reduce_scatter_sum`` started asynchronously (a group of two or more ranks): (the output
    shard, filled once ``work.wait()`` returns; the work handle). ``flat`` must live until then."""
    out = torch.empty(flat.numel() // comm.group_size(group), dtype=flat.dtype, device=flat.device)
    work = dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return out, work


def all_gather_flat(shard: torch.Tensor, group: object) -> torch.Tensor:
    """The shards of every rank of ``group`` concatenated in rank order (1-D)."""
    n = comm.group_size(group)
    if n == 1:
        return shard
    out = torch.empty(shard.numel() * n, dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out


def gather_flat_to_first(shard: torch.Tensor, group: object) -> torch.Tensor | None:
    """The shards of every rank of ``group`` concatenated in rank order on the group's rank 0
    (None on the others): checkpointing the distributed optimizer without a full copy per rank."""
    n = comm.group_size(group)
    if n == 1:
        return shard
    dst = dist.get_global_rank(group, 0)
    parts = [torch.empty_like(shard) for _ in range(n)] if comm.group_rank(group) == 0 else None
    dist.gather(shard.contiguous(), parts, dst=dst, group=group)
    return torch.cat(parts) if parts is not None else None
