"""Every torch.distributed call of the project lives here (and in pipeline/ddp/distributed.py).

Two kinds of helpers, all taking the process group explicitly (house rule 1). With
``group=None`` (a single process) or a group of one rank, each is the identity / a no-op,
so model and SNIP code call them unconditionally.

* Plain collectives for bookkeeping and SNIP statistics: ``all_reduce_sum``,
  ``all_reduce_max``, ``broadcast_tensor``, ``broadcast_object``, ``all_gather_object``,
  ``barrier``, ``amax_reducer``, the pipeline's point-to-point ``exchange`` and
  ``start_gather_from_sp`` (sequence_shard.py's prefetch: an asynchronous all-gather).
* Named autograd functions for tensor/sequence parallelism (Megatron's mappings), each
  documented with its forward op, backward op and group:

  ==========================  ==================================  ==================================
  function                    forward                             backward
  ==========================  ==================================  ==================================
  ``copy_to_tp``              identity                            all-reduce (sum) over TP
  ``reduce_from_tp``          all-reduce (sum) over TP            identity
  ``scatter_to_tp``           keep this rank's chunk of last dim  all-gather along the last dim
  ``gather_from_tp``          all-gather along the last dim       keep this rank's chunk
  ``scatter_to_sp``           keep this rank's chunk of seq dim   all-gather along seq
  ``gather_from_sp``          all-gather along seq                reduce-scatter along seq
  ``reduce_scatter_to_sp``    reduce-scatter along seq            all-gather along seq
  ==========================  ==================================  ==================================

Tensors are batch-first (B, S, D), so the sequence dim is 1. Gloo cannot carry FP8 dtypes
("Invalid scalar type"); gathers, broadcasts and p2p send them as ``uint8`` views.

Device rule (checked): every tensor handed to a collective or p2p op lives on its group's device,
``group_device(group)`` - the GPU ``init_distributed`` bound the group to on NCCL, the CPU on gloo.
NCCL refuses CPU tensors, gloo does not, so a tensor built from a default device (a bare
``torch.tensor(...)``) passes every CPU test and fails at its first NCCL call; here it fails on
gloo too. Build such tensors with ``device=topo.device``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

SEQ_DIM = 1  # activations are (B, S, D)

_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                 "float8_e8m0fnu") if hasattr(torch, n))


# --- group basics -------------------------------------------------------------------------
def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 for None or when torch.distributed is not initialized)."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This rank's index inside ``group`` (0 for None)."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _active(group: Any) -> bool:
    return group_size(group) > 1


def group_device(group: Any) -> torch.device:
    """The device of this rank's tensors in every collective on ``group`` (two or more ranks).

    NCCL: the GPU the group is bound to - ``init_distributed`` passes ``device_id`` to
    ``init_process_group``, which binds the default group and every subgroup to this rank's GPU.
    Gloo: the CPU. Never the current or default device, which is what a stray tensor follows."""
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    raise RuntimeError(f"a {backend!r} process group that is not bound to a device; start torch.distributed with "
                       f"parallel.distributed.init_distributed (it binds every group to this rank's GPU)")


def check_device(t: torch.Tensor, group: Any, op: str) -> torch.Tensor:
    """``t`` if it lives on ``group``'s device (``group_device``), else a RuntimeError naming ``op``,
    both devices and the fix. Every helper here checks before it communicates; ddp.py too."""
    want = group_device(group)
    if t.device != want:
        raise RuntimeError(f"{op}: a tensor on {t.device} handed to a collective whose group runs on {want}; "
                           f"create it on the topology's device (device=topo.device), not the default one")
    return t


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A view gloo/NCCL can move: FP8 tensors travel as uint8 (same bytes)."""
    return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t


# --- plain collectives (not differentiable) --------------------------------------------------
def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place sum over ``group``; returns ``t``."""
    if _active(group):
        dist.all_reduce(check_device(t, group, "all_reduce_sum"), op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place elementwise max over ``group``; returns ``t``."""
    if _active(group):
        dist.all_reduce(check_device(t, group, "all_reduce_max"), op=dist.ReduceOp.MAX, group=group)
    return t


def all_reduce_mean(t: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place mean over ``group``; returns ``t``."""
    n = group_size(group)
    if n > 1:
        dist.all_reduce(check_device(t, group, "all_reduce_mean"), op=dist.ReduceOp.SUM, group=group)
        t.div_(n)
    return t


def broadcast_tensor(t: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    """In-place broadcast of ``t`` from GLOBAL rank ``src`` to ``group``; returns ``t``."""
    if _active(group):
        dist.broadcast(_wire(check_device(t, group, "broadcast_tensor")), src=src, group=group)
    return t


def broadcast_object(obj: Any, src: int, group: Any) -> Any:
    """Picklable ``obj`` from GLOBAL rank ``src`` to every rank of ``group`` (returned everywhere);
    the pickled bytes travel on the group's device."""
    if not _active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=group_device(group))
    return box[0]


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    """List of every rank's ``obj`` in group-rank order (``[obj]`` without a group). torch moves the
    pickled bytes to the current CUDA device on NCCL (no device argument): init_distributed sets it
    to the group's device."""
    if not _active(group):
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any) -> None:
    """Wait for every rank of ``group`` (pass ``topo.world_group`` for all ranks); no-op for None.

    NCCL's barrier is an all-reduce of one element on some GPU: name it (``device_ids``), or torch
    guesses from the current device; gloo takes no ``device_ids``."""
    if _active(group):
        device = group_device(group)
        dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


def amax_reducer(group: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For ``PrecisionLinear.amax_reduce``: local amax -> max over the TP ``group`` (None if unsharded).

    The quantizer passes the amax of its local shard; every shard then scales with the
    amax of the whole tensor, as the unsharded layer would.
    """
    if not _active(group):
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        # A NaN amax must win on every rank as it would in the unsharded tensor, but a MAX
        # reduction may drop NaN (NaN compares false); +inf survives it and is non-finite too.
        a = amax.detach().float()
        a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
        return all_reduce_max(a, group)

    return reduce


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             group: Any) -> None:
    """Point-to-point: send each (tensor, GLOBAL dst) and receive into each (buffer, GLOBAL src) as
    ONE ``batch_isend_irecv``, then wait for all. Every tensor lives on the group's device.

    Why one batch: NCCL's send of a large message waits until the peer has posted the matching
    receive, and a rank's ops to one peer run in posting order on one stream. In 1F1B's steady
    state two neighbours exchange towards each other at the same time
    (``send_forward_recv_backward`` meets ``send_backward_recv_forward``); posting "every isend,
    then every irecv" makes each side's send wait for a receive queued behind the other side's
    send: a deadlock that gloo, which buffers sends, never shows. A batch is one NCCL group call
    (ncclGroupStart/End), whose ops progress together, so the order inside it does not matter.
    Megatron's other remedy, even stages send first and odd stages receive first, needs the
    parity right at every call site; the batch makes each call correct by itself (Megatron's
    default too). Its contract: a group's first batched call must involve every rank of it (it
    would create the group's communicator); ``init_distributed`` binds the groups to a device,
    which creates every communicator eagerly at start-up, so no batch is ever first. On gloo the
    batch is the same isends/irecvs one by one (gloo buffers sends).
    (tests/unit/test_p2p_rendezvous.py runs 1F1B under a model of these NCCL semantics.)

    ``group`` holds this rank and its peers (the PP group); without one (None) there are no
    peers, so there must be nothing to send or receive."""
    if group is None:
        assert not sends and not recvs, "exchange: peers need a process group (None is no group)"
        return
    ops = [dist.P2POp(dist.isend, _wire(check_device(t, group, "exchange (send)").contiguous()), dst, group)
           for t, dst in sends]
    ops += [dist.P2POp(dist.irecv, _wire(check_device(buf, group, "exchange (recv)")), src, group)
            for buf, src in recvs]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


# --- tensor helpers -----------------------------------------------------------------------------
def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} tensor-parallel ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class PendingGather:
    """An all-gather of ``x`` along ``dim`` over ``group`` (two or more ranks), started
    asynchronously: ``wait()`` returns the gathered tensor (the ranks' pieces concatenated in rank
    order). Until then the collective runs in the background (gloo's worker threads, NCCL's
    stream) while this rank computes; every rank of ``group`` must start it at the same point
    of its sequence of collectives on that group."""

    def __init__(self, x: torch.Tensor, dim: int, group: Any) -> None:
        self._x = check_device(x, group, "all-gather").contiguous()  # kept alive until the collective has read it
        self._parts = [torch.empty_like(self._x) for _ in range(group_size(group))]
        self._dim = dim
        self._work = dist.all_gather(self._parts, self._x, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self._work.wait()
        out = torch.cat(self._parts, dim=self._dim)
        self._x = self._parts = None  # the pieces are freed with this handle's last use
        return out


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    return PendingGather(x, dim, group).wait()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {n} ranks")
    inputs = [c.contiguous() for c in check_device(x, group, "reduce-scatter").chunk(n, dim=dim)]
    out = torch.empty_like(inputs[0])
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM, group=group)
    return out


def _all_reduce_copy(x: torch.Tensor, group: Any) -> torch.Tensor:
    # A copy, not in place: the input may be saved for another backward.
    out = check_device(x, group, "all-reduce").clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


# --- autograd functions -------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient over the TP group.

    Placed before a column-parallel GEMM whose input is replicated: each rank's partial
    dX (from its weight shard) is summed into the full dX."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_copy(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum) over the TP group. Backward: identity.

    Placed after a row-parallel GEMM: sums the partial outputs of the K shards."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather along the last dim (TP group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather along the last dim (TP group). Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence dim. Backward: all-gather along seq (TP group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """Forward: all-gather along the sequence dim (TP group). Backward: reduce-scatter along seq.

    Enters a column-parallel region under sequence parallelism: the gathered input is used by
    every rank's weight shard, so each rank's gradient is partial and must be summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along the sequence dim (TP group). Backward: all-gather along seq.

    Leaves a row-parallel region under sequence parallelism (replaces the all-reduce)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward, all-reduce backward over TP (see ``_CopyToTP``)."""
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce forward, identity backward over TP (see ``_ReduceFromTP``)."""
    return _ReduceFromTP.apply(x, group) if _active(group) else x


def scatter_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Split the last dim forward, all-gather backward over TP (see ``_ScatterToTP``)."""
    return _ScatterToTP.apply(x, group) if _active(group) else x


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather the last dim forward, split backward over TP (see ``_GatherFromTP``)."""
    return _GatherFromTP.apply(x, group) if _active(group) else x


def scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Split the sequence dim forward, all-gather backward over TP (see ``_ScatterToSP``)."""
    return _ScatterToSP.apply(x, group) if _active(group) else x


def gather_from_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather seq forward, reduce-scatter backward over TP (see ``_GatherFromSP``)."""
    return _GatherFromSP.apply(x, group) if _active(group) else x


def start_gather_from_sp(x: torch.Tensor, group: Any) -> PendingGather:
    """``gather_from_sp``'s forward (all-gather along seq over TP, no autograd) started
    asynchronously; ``wait()`` gives the same bits. ``group`` must have two or more ranks."""
    return PendingGather(x, SEQ_DIM, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Reduce-scatter seq forward, all-gather backward over TP (see ``_ReduceScatterToSP``)."""
    return _ReduceScatterToSP.apply(x, group) if _active(group) else x
