"""Combine per-rank SNIP statistics into one snapshot of the whole model.

Each rank's snapshot covers the linears of its pipeline stage, measured on its TP shard and
its DP replica's probe data, with every quantity an additive sum (stats.py). Here:

  * per-linear sums are added over the TP group (shards of one linear),
  * then averaged over the DP group (replicas estimate the same quantities on other data),
  * the propagation pass (whose gradient changes land on every stage) is added over the
    model-parallel group (TP x PP) and averaged over DP, as is the total update norm,
  * and the stages' linears are gathered over the PP group.

Approximations, stated: errors of shards that are summed afterwards (row-parallel outputs,
column-parallel input gradients) are treated as independent (‖Σe‖² ≈ Σ‖e‖²), and
TP-replicated parameters (norm weights) count once per TP rank in the update norm.
Collectives go through ``parallel.comm``; with one process everything is the identity.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_snip.parallel import comm
from megatron_snip.parallel.topology import ParallelTopology

_IDENTITY_FIELDS = ("layer", "linear", "shape")


def _numeric_items(s: dict[str, Any]) -> list[tuple[tuple[str, ...], float]]:
    items = []
    for k in sorted(s):
        if k in _IDENTITY_FIELDS:
            continue
        if k == "per_format":
            for f in sorted(s[k]):
                items.extend(((k, f, m), float(v)) for m, v in sorted(s[k][f].items()))
        else:
            items.append(((k,), float(s[k])))
    return items


def _write(s: dict[str, Any], path: tuple[str, ...], value: float) -> None:
    if len(path) == 1:
        s[path[0]] = value
    else:
        s[path[0]][path[1]][path[2]] = value


def _reduce_vector(values: list[float], sum_group: Any, mean_group: Any, device: str) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)  # the groups' device (NCCL: the GPU)
    comm.all_reduce_sum(t, sum_group)
    comm.all_reduce_mean(t, mean_group)
    return t.tolist()


def reduce_snapshot(snapshot: dict[str, Any], topo: ParallelTopology) -> dict[str, Any]:
    """The whole-model snapshot (identical on every rank) from this rank's partial one."""
    if not topo.is_distributed:
        return snapshot
    linears = snapshot["linears"]
    keys = sorted(linears)  # the same on every rank of this stage
    flat = [(key, path, v) for key in keys for path, v in _numeric_items(linears[key])]
    reduced = _reduce_vector([v for _, _, v in flat], topo.tp_group, topo.dp_group, topo.device)
    for (key, path, _), v in zip(flat, reduced):
        _write(linears[key], path, v)

    prop_keys = sorted(snapshot["propagation"])  # every linear of the model, on every rank
    prop = [snapshot["propagation"][k][m] for k in prop_keys for m in ("num", "den")]
    # Whole-model sums over TP x PP, means over DP: the update's squared norm and the probe
    # gradient's (each replicated tensor counted on one TP rank; a DP replica's own probe batches).
    prop = _reduce_vector(prop + [snapshot["total_sq_update"], snapshot["probe_sq_grad"]], topo.mp_group,
                          topo.dp_group, topo.device)
    probe_sq_grad = prop.pop()
    total_sq_update = prop.pop()
    propagation = {k: {"num": prop[2 * i], "den": prop[2 * i + 1]} for i, k in enumerate(prop_keys)}
    probe_loss = _reduce_vector([snapshot["probe_loss_sum"]], None, topo.dp_group, topo.device)[0]

    merged: dict[str, Any] = {}
    for part in comm.all_gather_object(linears, topo.pp_group):
        merged.update(part)
    return {**snapshot, "linears": dict(sorted(merged.items(), key=lambda kv: (kv[1]["layer"], kv[0]))),
            "propagation": propagation, "total_sq_update": total_sq_update, "probe_sq_grad": probe_sq_grad,
            "probe_loss_sum": probe_loss}
