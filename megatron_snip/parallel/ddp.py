"""Gradient reduction and global-norm clipping for TP x PP x DP.

Choice: gradients are reduced by a bucketed all-reduce *after* backward (not torch DDP's
hooks). That works unchanged with the pipeline schedule's many backward calls per step and
with SNIP probe passes (which must not touch other replicas' gradients), gives the same
result on gloo and NCCL, and at this scale the lost overlap of communication with backward
does not matter. Overlap (DDP-style hooks or Megatron's distributed optimizer) is the
upgrade path for large runs.

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

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_snip.parallel import comm
from megatron_snip.parallel.topology import ParallelTopology


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

    def reduce(self) -> None:
        """Steps 1 and 2 of the module docstring (call once per optimizer step, after backward)."""
        sp = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        self._reduce(sp, self.topo.tp_group, average=False)
        self._reduce(self.params, self.topo.dp_group, average=True)

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient (fp32 scalar, the same on every rank of a replica)."""
        counted = [p.grad for p in self.params
                   if p.grad is not None and (getattr(p, "tensor_parallel", False) or self.topo.tp_rank == 0)]
        device = self.params[0].device if self.params else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if counted:
            norms = torch._foreach_norm(counted, 2.0)
            sq = torch.stack([n.float() for n in norms]).pow(2).sum()
        return comm.all_reduce_sum(sq, self.topo.mp_group).sqrt()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale grads so the global norm is <= ``max_norm`` (inf = no clipping); returns the norm before.

        Same rule as ``torch.nn.utils.clip_grad_norm_``: coef = max_norm / (norm + 1e-6), capped at 1.
        A non-finite norm makes every grad non-finite, which the trainer's guard then skips."""
        norm = self.global_norm()
        grads = [p.grad for p in self.params if p.grad is not None]
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm

    def global_numel(self) -> int:
        """Parameters of the whole model (each replicated tensor counted once)."""
        n = sum(p.numel() for p in self.params if getattr(p, "tensor_parallel", False) or self.topo.tp_rank == 0)
        device = self.params[0].device if self.params else torch.device("cpu")  # NCCL needs device tensors
        return int(comm.all_reduce_sum(torch.tensor(float(n), dtype=torch.float64, device=device),
                                       self.topo.mp_group).item())
