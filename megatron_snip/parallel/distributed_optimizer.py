"""ZeRO-1 distributed AdamW over the DP group (Megatron's ``--use-distributed-optimizer``).

``training.distributed_optimizer = true``. Each DP rank keeps AdamW's ``exp_avg`` and
``exp_avg_sq`` (fp32) for only its 1/dp shard of every bucket (``parallel/ddp.ShardBucket``):
8/dp bytes per parameter instead of 8. Per optimizer step:

1. ``ShardedGradReducer.reduce``: sequence-parallel grads summed over TP, then per bucket a
   reduce-scatter (sum) over DP and a division by dp -> this rank's averaged grad shard.
2. ``clip_``: global norm from the shards (summed over DP and TP x PP), shards scaled.
3. ``step``: per bucket, AdamW on a flat copy of this rank's parameter shard with the shard's
   moments - torch's own AdamW kernel (``torch.optim.adam.adam``, decoupled weight decay,
   foreach on CPU, fused on CUDA), the elementwise math of ``torch.optim.AdamW``, so each
   element is updated exactly as the unsharded optimizer would; then an all-gather over DP
   writes the updated shards into every replica's parameters.

The parameters themselves are the fp32 master weights (the model holds fp32 weights and
runs under autocast), so no separate master copy exists; gradients stay full-size (ZeRO-1).

Why this and not FSDP2's ``fully_shard``: FSDP2 shards *parameters* (ZeRO-3, or ZeRO-2 with
``reshard_after_forward=False``) by wrapping modules in DTensors and driving their all-gathers
from forward/backward hooks. Our model is explicit TP (``parallel/comm.py`` autograd
collectives on plain tensors, the 1F1B schedule calling forward/backward per micro-batch,
SNIP probe passes that run extra forward/backwards and read ``weight`` directly, and the
precision backends that quantize ``weight`` per GEMM): every one of those would see DTensors
or resharded weights. Sharding only the optimizer state needs three collectives at the step
boundary and leaves the model, the schedule and SNIP untouched.

Checkpoints: ``state_dict`` gathers the shards onto DP rank 0 in ``torch.optim.AdamW``'s
format (Megatron's "gather to DP rank 0" parameter-state format), so a checkpoint does not
depend on dp or on this option: an unsharded run's checkpoint loads here and vice versa.

With ``training.overlap_grad_reduce`` the reduce-scatters start during the last micro-batch's
backward, bucket by bucket, as their gradients are finished (``parallel/ddp.GradReducer``'s overlap,
the same hooks as the plain all-reduce's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam

from megatron_snip.parallel import comm
from megatron_snip.parallel.ddp import ShardedGradReducer, gather_flat_to_first
from megatron_snip.parallel.topology import ParallelTopology

_MOMENTS = ("exp_avg", "exp_avg_sq")


class DistributedOptimizer:
    """AdamW whose moments are sharded over DP; the trainer's ``grads`` is its ``reducer``.

    Args:
        groups: param groups as for ``torch.optim.AdamW`` (``{"params": [...], "weight_decay": wd}``),
            the same on every DP replica.
        topo: the topology (dp group for shards, tp/mp groups for the reducer).
        lr, betas, eps: AdamW hyper-parameters (``param_groups[i]["lr"]`` is read at every step).
        fused: torch's fused CUDA kernel (else foreach), as ``training/optim.build_optimizer`` picks.
        bucket_mb: reduce-scatter bucket size (``training.grad_bucket_mb``).
        overlap: start the reduce-scatters during backward (``training.overlap_grad_reduce``).
    """

    def __init__(self, groups: list[dict], topo: ParallelTopology, *, lr: float, betas: tuple[float, float],
                 eps: float, fused: bool, bucket_mb: float = 25.0, overlap: bool = False) -> None:
        self.param_groups = [{**g, "params": list(g["params"]), "lr": lr, "betas": tuple(betas), "eps": eps}
                             for g in groups]
        self.topo = topo
        self.fused = fused
        self.reducer = ShardedGradReducer([g["params"] for g in self.param_groups], topo, bucket_mb, overlap=overlap)
        # Per bucket: {"step": scalar tensor, "exp_avg": shard, "exp_avg_sq": shard}; empty before the first step.
        self.shard_state: list[dict[str, torch.Tensor]] = [{} for _ in self.reducer.buckets]
        self._where = {id(p): (bi, i) for bi, b in enumerate(self.reducer.buckets) for i, p in enumerate(b.params)}

    # --- the torch.optim.Optimizer surface the trainer uses -----------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None
        self.reducer.clear()

    def _new_state(self, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        # Same step-counter placement as torch's AdamW: on the device for the fused kernel, else CPU.
        step = torch.zeros((), dtype=torch.float32, device=shard.device if self.fused else "cpu")
        return {"step": step, "exp_avg": torch.zeros_like(shard), "exp_avg_sq": torch.zeros_like(shard)}

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shards (after ``reducer.reduce`` and ``clip_``), then all-gather.

        With ``fused``, a 0-d fp32 ``self.found_inf`` on the device (1 = skip; set by
        ``training/step_guard.optimizer_step``, as torch's AdamW takes it) makes the kernel leave
        the shards, moments and step counts untouched."""
        found_inf = getattr(self, "found_inf", None) if self.fused else None
        for i, (b, grad) in enumerate(zip(self.reducer.buckets, self.reducer.grad_shards)):
            assert grad is not None, "DistributedOptimizer.step before reducer.reduce()"
            group = self.param_groups[b.group]
            param = self.reducer.param_shard(i)
            st = self.shard_state[i] or self._new_state(param)
            self.shard_state[i] = st
            adam([param], [grad], [st["exp_avg"]], [st["exp_avg_sq"]], [], [st["step"]],
                 foreach=not self.fused, fused=self.fused or None, decoupled_weight_decay=True, amsgrad=False,
                 beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, found_inf=found_inf)
            self.reducer.all_gather_params(i, param)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments and step counters)."""
        return sum(t.numel() * t.element_size() for st in self.shard_state for t in st.values())

    # --- whole-parameter views (SNIP reads AdamW's m and v) -------------------------------------
    def full_state(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """``{"step", "exp_avg", "exp_avg_sq"}`` of ``param`` as whole tensors shaped like it, as the
        unsharded AdamW's ``state[param]`` would hold them ({} before the first step).

        A collective over DP (each rank contributes the piece it owns, zeros elsewhere, summed):
        every DP rank must call it for the same params in the same order."""
        bi, i = self._where[id(param)]
        st = self.shard_state[bi]
        if not st:
            return {}
        b = self.reducer.buckets[bi]
        piece = b.piece(i, self.topo.dp_rank)
        out: dict[str, torch.Tensor] = {"step": st["step"].clone()}
        for key in _MOMENTS:
            full = torch.zeros(param.numel(), dtype=st[key].dtype, device=st[key].device)
            if piece is not None:
                at, shard_at, n = piece
                full[at:at + n] = st[key][shard_at:shard_at + n]
            out[key] = comm.all_reduce_sum(full, self.topo.dp_group).view_as(param)
        return out

    # --- checkpoints ------------------------------------------------------------------------
    def _index(self) -> dict[int, int]:
        """Param -> its index in ``torch.optim.AdamW.state_dict()`` (params numbered over the groups in order)."""
        return {id(p): n for n, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self) -> dict[str, Any] | None:
        """``torch.optim.AdamW.state_dict()``'s format with whole (CPU) tensors, on DP rank 0; None on
        the other DP ranks. A collective over DP (every DP rank calls it)."""
        index = self._index()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for b, st in zip(self.reducer.buckets, self.shard_state):
            if not st:
                continue
            # Gathered one bucket at a time and moved to the CPU: device memory grows by one bucket x dp only.
            full = {k: gather_flat_to_first(st[k], self.topo.dp_group) for k in _MOMENTS}
            if full["exp_avg"] is None:
                continue
            full = {k: v.cpu() for k, v in full.items()}
            for p, off in zip(b.params, b.offsets):
                state[index[id(p)]] = {"step": st["step"].clone(),
                                       **{k: full[k][off:off + p.numel()].view_as(p).clone() for k in _MOMENTS}}
        if self.topo.dp_rank != 0:
            return None
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "amsgrad": False, "maximize": False,
                   "foreach": not self.fused, "fused": self.fused or None, "capturable": False, "differentiable": False,
                   "decoupled_weight_decay": True, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load an AdamW state dict (from this optimizer at any dp, or from ``torch.optim.AdamW``):
        every rank keeps its shard. Hyper-parameters come from the saved groups (the LR is set per step)."""
        saved_groups = sd["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"optimizer checkpoint has param groups of sizes {[len(g['params']) for g in saved_groups]}, "
                             f"this model has {[len(g['params']) for g in self.param_groups]}; it was saved for "
                             f"another model or layout")
        for g, sg in zip(self.param_groups, saved_groups):
            g.update({k: sg[k] for k in ("lr", "betas", "eps", "weight_decay")})
        index = self._index()
        saved = {int(k): v for k, v in sd["state"].items()}
        for bi, b in enumerate(self.reducer.buckets):
            entries = [saved.get(index[id(p)]) for p in b.params]
            if all(e is None for e in entries):
                self.shard_state[bi] = {}
                continue
            steps = {float(e["step"]) for e in entries if e is not None}
            if None in entries or len(steps) > 1:
                raise ValueError(f"optimizer checkpoint: parameters {[index[id(p)] for p in b.params]} share one "
                                 f"distributed-optimizer bucket but have state at steps {sorted(steps)} (or none): "
                                 f"they cannot be sharded together; resume with training.distributed_optimizer=false")
            lo, hi = b.owned(self.topo.dp_rank)
            device = b.params[0].device
            st = self._new_state(torch.empty(0, device=device))
            st["step"].fill_(steps.pop())
            for k in _MOMENTS:
                st[k] = b.flatten([e[k].to(device) for e in entries], self.topo.dp)[lo:hi].clone()
            self.shard_state[bi] = st
