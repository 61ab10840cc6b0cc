"""Gradient reduction and global-norm clipping for TP x PP x DP.

Choice: gradients are reduced by our own bucketed collectives (not torch DDP's module
wrapper), which work unchanged with the pipeline schedule's many backward calls per step and
with SNIP probe passes (which must not touch other replicas' gradients), and give the same
result on gloo and NCCL. Without the distributed optimizer (``GradReducer``) each bucket is
all-reduced and averaged over DP; with it (``ShardedGradReducer``, ZeRO-1,
``training.distributed_optimizer``) step 2 becomes a reduce-scatter, so each DP rank ends with
the averaged gradient of only its shard, and the norm of step 3 sums the shards over DP;
``all_gather_params`` brings the updated shards back to every replica.

Overlap (``training.overlap_grad_reduce``), one mechanism in ``GradReducer`` for both, as torch
DDP's reducer and Megatron's ``--overlap-grad-reduce`` do it: a post-accumulate-grad hook on
every parameter counts the backward passes of the step (``start_step(m)`` arms it for m
micro-batches; SNIP's probe passes run unarmed); once a parameter has its m-th gradient it is
final, and once every parameter of a bucket is final the bucket's collective (all-reduce or
reduce-scatter: the subclass's ``_start``) starts asynchronously while backward goes on.
Buckets start in one fixed order on every DP rank (descending index, about the order backward
finishes them, as DDP buckets in reverse parameter order) so the collectives line up; a bucket
that is not finished when its turn comes holds the later ones back until ``reduce``, which
starts what is left and waits for all (before clipping and the optimizer step). Buckets
holding sequence-parallel parameters wait for ``reduce`` too (their TP sum must come first,
unchanged); the all-reduce path buckets them apart so they hold back no other parameter (under
TP, ZeRO-1's replicated buckets are those norm weights anyway). Each collective
reduces the very bucket the non-overlapped path would, so the results are the same bits. At
most two buckets are in flight: their flat copies are the overlap's only extra memory.

Per step, after all micro-batches' backward:
  1. ``sequence_parallel`` params (norm weights under SP): grads summed over the TP group
     (each TP rank saw a different slice of the sequence).
  2. every grad averaged over the DP group (replicas saw different data).
  3. global grad norm over the whole model: sharded (``tensor_parallel``) params counted on
     every TP rank, replicated ones once (TP rank 0), summed over the model-parallel group
     (TP x PP); after step 2 DP replicas hold identical grads, so no DP sum.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

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


def partition(tensors: list, key: Callable[[Any], Hashable], bucket_bytes: int) -> list[list]:
    """Split ``tensors`` (parameters or gradients) into buckets of about ``bucket_bytes``: per
    ``key`` (in the order keys first appear), consecutive tensors until the bucket reaches the
    size; a tensor is never split across buckets. The same on every rank given the same list."""
    by_key: dict[Hashable, list] = {}
    for t in tensors:
        by_key.setdefault(key(t), []).append(t)
    buckets: list[list] = []
    for ts in by_key.values():
        current, size = [], 0
        for t in ts:
            current.append(t)
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
    return buckets


def _start_all_reduce(grads: list[torch.Tensor], group: object) -> tuple[torch.Tensor, object]:
    """Start summing ``grads`` (one dtype) over ``group`` (two or more ranks) as one flat
    tensor: (the flat copy, summed once ``work.wait()`` returns; the work handle)."""
    flat = comm.check_device(_flatten_dense_tensors(grads), group, "gradient all-reduce")
    return flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _finish_all_reduce(grads: list[torch.Tensor], flat: torch.Tensor, work: object, n: int, *, average: bool) -> None:
    """Wait for ``_start_all_reduce``'s ``work`` and write the sum (or the mean over ``n`` ranks) into ``grads``."""
    work.wait()
    if average:
        flat.div_(n)
    for g_old, g_new in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g_old.copy_(g_new)


def _bucketed_all_reduce(grads: list[torch.Tensor], group: object, bucket_bytes: int, *, average: bool) -> None:
    """Sum (or average) ``grads`` in place over ``group``, one flat bucket per dtype at a time."""
    n = comm.group_size(group)
    if n == 1 or not grads:
        return
    for bucket in partition(grads, lambda g: g.dtype, bucket_bytes):
        _finish_all_reduce(bucket, *_start_all_reduce(bucket, group), n, average=average)


def _sequence_parallel(p: nn.Parameter, topo: ParallelTopology) -> bool:
    """Whether p's gradient is summed over TP before the DP reduction (a norm weight under SP)."""
    return topo.tp > 1 and bool(getattr(p, "sequence_parallel", False))


class GradReducer:
    """Reduces and clips the gradients of one rank's parameters (its TP shard of its PP stage):
    each bucket all-reduced (sum) over the DP group and divided by dp, after backward or, with
    ``overlap``, started during the step's last backward pass (module docstring).

    Args:
        params: this rank's parameters (``model.parameters()``), in the same order on every
            DP replica (true when replicas are built from the same config).
        topo: the topology (groups: tp for sequence-parallel grads, dp for averaging, mp for norms).
        bucket_mb: bucket size (``training.grad_bucket_mb``).
        overlap: start each bucket's collective from the gradient hooks (``training.overlap_grad_reduce``);
            only where dp > 1.
        buckets: the parameters of each bucket (a subclass's layout); default: ``partition`` by
            dtype and sequence-parallel-ness.
    """

    MAX_IN_FLIGHT = 2  # overlapped buckets launched and not yet waited for (bounds their flat copies)

    def __init__(self, params: Iterable[nn.Parameter], topo: ParallelTopology, bucket_mb: float = 25.0, *,
                 overlap: bool = False, buckets: list[list[nn.Parameter]] | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.topo = topo
        self.bucket_bytes = int(bucket_mb * 2**20)
        # Sequence-parallel params apart: a bucket holding one waits for ``reduce`` (TP sum first).
        self.bucket_params = buckets if buckets is not None else partition(
            self.params, lambda p: (p.dtype, _sequence_parallel(p, topo)), self.bucket_bytes)
        self.overlap = overlap and topo.dp > 1
        # Without overlap the buckets run one after the other in ``reduce`` (one flat copy at a time).
        self._max_in_flight = self.MAX_IN_FLIGHT if self.overlap else 1
        # The order buckets start in, the same on every DP rank: backward finishes the last
        # parameters first; sequence-parallel buckets last (their TP sum runs in ``reduce``).
        sp = {i for i, ps in enumerate(self.bucket_params) if any(_sequence_parallel(p, topo) for p in ps)}
        self._order = ([i for i in reversed(range(len(self.bucket_params))) if i not in sp]
                       + sorted(sp, reverse=True))
        self._hookable = len(self._order) - len(sp)  # the hooks may start _order[:_hookable]
        self._bucket_of = {id(p): i for i, ps in enumerate(self.bucket_params) for p in ps}
        self._armed_for = 0  # backward passes of the step being counted (0: hooks idle)
        self._in_flight: list[tuple[int, object, torch.Tensor | None]] = []  # (bucket, work, flat input)
        self._reset()
        self.launched_in_backward = 0  # buckets the hooks started during the last step (for tests, logs)
        if self.overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    # --- overlap ---------------------------------------------------------------------------------
    def _reset(self) -> None:
        assert not self._in_flight, "a bucket's collective was left in flight"
        self._accumulated: dict[int, int] = {}  # id(param) -> gradients accumulated this step
        self._finished = [0] * len(self.bucket_params)  # params of each bucket with their final gradient
        self._next = 0  # position in _order of the next bucket to start

    def start_step(self, micro_batches: int) -> None:
        """Called before a step's ``micro_batches`` backward passes: arms the overlap's hooks to count them."""
        if self.overlap:
            self._in_flight = []
            self._reset()
            self._armed_for, self.launched_in_backward = micro_batches, 0

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
        return self._finished[i] == len(self.bucket_params[i])

    def _launch(self, i: int) -> None:
        """Start bucket ``i``'s collective (waiting first for the oldest if the limit is in flight)."""
        if len(self._in_flight) >= self._max_in_flight:
            self._wait_oldest()
        self._in_flight.append((i, *self._start(i)))

    def _wait_oldest(self) -> None:
        i, work, flat = self._in_flight.pop(0)
        self._finish(i, work, flat)  # the flat input is freed after this

    def _start(self, i: int) -> tuple[object, torch.Tensor | None]:
        """Start bucket ``i``'s DP all-reduce: (work handle, flat copy), or (None, None) at dp=1."""
        if self.topo.dp == 1:
            return None, None
        grads = []
        for p in self.bucket_params[i]:
            # A parameter without a gradient contributes zeros, so every rank reduces the same buckets.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat, work = _start_all_reduce(grads, self.topo.dp_group)
        return work, flat

    def _finish(self, i: int, work: object, flat: torch.Tensor | None) -> None:
        """Wait for bucket ``i``'s all-reduce and write the DP mean into its params' ``grad``."""
        if work is not None:
            _finish_all_reduce([p.grad for p in self.bucket_params[i]], flat, work, self.topo.dp, average=True)

    # --- the step's reduction ----------------------------------------------------------------------
    def _reduce(self, params: list[nn.Parameter], group: object, *, average: bool) -> None:
        if comm.group_size(group) == 1 or not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _bucketed_all_reduce([p.grad for p in params], group, self.bucket_bytes, average=average)

    def reduce(self) -> None:
        """Steps 1 and 2 of the module docstring (call once per optimizer step, after backward): SP
        grads summed over TP, then every bucket's DP collective (``_start``/``_finish``); with
        overlap, the buckets the hooks started are only waited for here."""
        sp = [p for p in self.params if _sequence_parallel(p, self.topo)]
        self._reduce(sp, self.topo.tp_group, average=False)
        self._armed_for = 0
        for i in self._order[self._next:]:
            self._launch(i)
        while self._in_flight:
            self._wait_oldest()
        self._reset()

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
    """Split each group's params into buckets of about ``bucket_bytes`` (``partition``: a param is
    never split across buckets), keyed by (group, dtype, TP-sharded). The same on every DP replica."""
    buckets: list[ShardBucket] = []
    for gi, params in enumerate(groups):
        for ps in partition(params, lambda p: (p.dtype, bool(getattr(p, "tensor_parallel", False))), bucket_bytes):
            offsets = [0]
            for q in ps[:-1]:
                offsets.append(offsets[-1] + q.numel())
            numel = offsets[-1] + ps[-1].numel()
            tensor_parallel = bool(getattr(ps[0], "tensor_parallel", False))
            buckets.append(ShardBucket(ps, gi, offsets, numel, -(-numel // dp), tensor_parallel))
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

    def __init__(self, groups: list[list[nn.Parameter]], topo: ParallelTopology, bucket_mb: float = 25.0, *,
                 overlap: bool = False) -> None:
        self.buckets = shard_buckets(groups, topo.dp, int(bucket_mb * 2**20))
        super().__init__([p for g in groups for p in g], topo, bucket_mb, overlap=overlap,
                         buckets=[b.params for b in self.buckets])
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.buckets)

    def _start(self, i: int) -> tuple[object, torch.Tensor | None]:
        """Start bucket ``i``'s reduce-scatter (sum) over DP into ``grad_shards[i]``: (work, flat input);
        at dp=1 the flat bucket is the shard (work None)."""
        b = self.buckets[i]
        flat = b.flatten([p.grad for p in b.params], self.topo.dp)
        if self.topo.dp == 1:
            self.grad_shards[i] = flat
            return None, None
        self.grad_shards[i], work = reduce_scatter_sum_async(flat, self.topo.dp_group)
        return work, flat

    def _finish(self, i: int, work: object, flat: torch.Tensor | None) -> None:
        """Wait for bucket ``i``'s reduce-scatter and divide its shard by dp (the all-reduce path's
        two operations, so at DP=2 the shards are bitwise its values)."""
        if work is not None:
            work.wait()
            self.grad_shards[i].div_(self.topo.dp)

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


def reduce_scatter_sum_async(flat: torch.Tensor, group: object) -> tuple[torch.Tensor, object]:
    """Start summing ``flat`` (numel a multiple of the group size) over ``group`` (two or more ranks),
    keeping this rank's contiguous 1/n: (the output shard, filled once ``work.wait()`` returns; the
    work handle). ``flat`` must live until then."""
    out = torch.empty(flat.numel() // comm.group_size(group), dtype=flat.dtype, device=flat.device)
    flat = comm.check_device(flat, group, "gradient reduce-scatter")
    work = dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return out, work


def all_gather_flat(shard: torch.Tensor, group: object) -> torch.Tensor:
    """The shards of every rank of ``group`` concatenated in rank order (1-D)."""
    n = comm.group_size(group)
    if n == 1:
        return shard
    out = torch.empty(shard.numel() * n, dtype=shard.dtype, device=shard.device)
    shard = comm.check_device(shard, group, "parameter all-gather")
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
    shard = comm.check_device(shard, group, "optimizer-state gather")
    dist.gather(shard.contiguous(), parts, dst=dst, group=group)
    return torch.cat(parts) if parts is not None else None
