"""parallel/comm.py on 2 gloo ranks: each autograd mapping's forward and backward, the plain
collectives the SNIP code uses, FP8 over gloo, and point-to-point exchange.

Values are small integers in fp32, so sums are exact and every check is bitwise.
"""

from __future__ import annotations

import torch
from dist_harness import run_ranks

from megatron_snip.parallel import comm
from megatron_snip.parallel.distributed import init_distributed


def _grad_of(fn, x, upstream):
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(upstream)
    return y.detach(), x.grad


def _worker(rank: int, world: int) -> str:
    topo = init_distributed(tp=world, pp=1, device_type="cpu", timeout_s=60)
    g = topo.tp_group
    full = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)  # (B, S, D), same on both ranks
    up = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6).flip(-1)
    k = rank + 1  # rank-dependent factor; sum over ranks = 3
    seq_chunk = lambda t: t.chunk(world, dim=1)[rank]
    last_chunk = lambda t: t.chunk(world, dim=-1)[rank]

    y, dx = _grad_of(lambda x: comm.copy_to_tp(x, g), full, k * up)
    assert torch.equal(y, full) and torch.equal(dx, 3 * up), "copy_to_tp: identity fwd, all-reduce bwd"

    y, dx = _grad_of(lambda x: comm.reduce_from_tp(x, g), k * full, up)
    assert torch.equal(y, 3 * full) and torch.equal(dx, up), "reduce_from_tp: all-reduce fwd, identity bwd"

    y, dx = _grad_of(lambda x: comm.scatter_to_tp(x, g), full, last_chunk(k * up))
    assert torch.equal(y, last_chunk(full))
    assert torch.equal(dx, torch.cat([c * (i + 1) for i, c in enumerate(up.chunk(world, -1))], -1)), "scatter_to_tp bwd"

    y, dx = _grad_of(lambda x: comm.gather_from_tp(x, g), last_chunk(full), k * up)
    assert torch.equal(y, full) and torch.equal(dx, last_chunk(k * up)), "gather_from_tp: all-gather fwd, split bwd"

    y, dx = _grad_of(lambda x: comm.scatter_to_sp(x, g), full, seq_chunk(k * up))
    assert torch.equal(y, seq_chunk(full))
    assert torch.equal(dx, torch.cat([c * (i + 1) for i, c in enumerate(up.chunk(world, 1))], 1)), "scatter_to_sp bwd"

    y, dx = _grad_of(lambda x: comm.gather_from_sp(x, g), seq_chunk(full), k * up)
    assert torch.equal(y, full) and torch.equal(dx, seq_chunk(3 * up)), "gather_from_sp: all-gather fwd, reduce-scatter bwd"

    y, dx = _grad_of(lambda x: comm.reduce_scatter_to_sp(x, g), k * full, seq_chunk(k * up))
    assert torch.equal(y, seq_chunk(3 * full))
    assert torch.equal(dx, torch.cat([c * (i + 1) for i, c in enumerate(up.chunk(world, 1))], 1)), "reduce_scatter_to_sp bwd"

    # plain collectives
    assert comm.all_reduce_sum(torch.tensor([k, 10.0]), g).tolist() == [3.0, 20.0]
    assert comm.all_reduce_max(torch.tensor([k, -k]), g).tolist() == [2.0, -1.0]
    assert comm.all_reduce_mean(torch.tensor([float(k)]), g).tolist() == [1.5]
    assert comm.broadcast_object({"plan": "x", "r": rank}, src=1, group=g) == {"plan": "x", "r": 1}
    assert comm.all_gather_object(("r", rank), g) == [("r", 0), ("r", 1)]
    reduce = comm.amax_reducer(g)
    assert reduce is not None and reduce(torch.tensor(float(k))).item() == 2.0
    # a NaN amax on one shard must poison every shard (as in the unsharded tensor), not be dropped
    assert reduce(torch.tensor(float("nan") if rank == 0 else 1.0)).item() == float("inf")
    assert comm.amax_reducer(None) is None and comm.all_reduce_sum(torch.ones(1), None).item() == 1.0

    # FP8 cannot go through gloo as such; the helpers send its bytes
    f8 = (torch.tensor([0.5, -2.0, 448.0]) * (1 if rank == 0 else 0)).to(torch.float8_e4m3fn)
    comm.broadcast_tensor(f8, src=0, group=g)
    assert f8.float().tolist() == [0.5, -2.0, 448.0]

    # point-to-point in both directions at once
    other = 1 - rank
    recv = torch.empty(3)
    comm.exchange([(torch.full((3,), float(rank)), other)], [(recv, other)], topo.world_group)
    assert recv.tolist() == [float(other)] * 3
    comm.barrier(topo.world_group)
    return "ok"


def test_comm_mappings_and_collectives_on_two_ranks():
    assert run_ranks(_worker, 2, timeout_s=60) == ["ok", "ok"]


# --- the device rule: every tensor handed to a collective lives on its group's device ----------------
# gloo accepts tensors of any device: a meta tensor "all-reduces" without error (a no-op), and a
# CPU tensor would pass where NCCL refuses it. So these workers make the default device `meta`
# while the groups (gloo) run on the CPU: a tensor built without an explicit device - the bug
# NCCL would catch at its first call - lands on meta, which no group runs on. The tests cannot
# pass vacuously: the first shows the rule refusing such a tensor in every helper; the second
# checks the reduced values, so a skipped or no-op collective fails it too.
def _device_rule_worker(rank: int, world: int) -> str:
    topo = init_distributed(tp=world, pp=1, device_type="cpu", timeout_s=60)
    g = topo.tp_group
    assert topo.device == "cpu" and comm.group_device(g) == torch.device("cpu")
    torch.set_default_device("meta")
    stray = torch.ones(2, 4)  # the default device: meta
    helpers = {
        "all_reduce_sum": lambda: comm.all_reduce_sum(stray, g),
        "all_reduce_max": lambda: comm.all_reduce_max(stray, g),
        "all_reduce_mean": lambda: comm.all_reduce_mean(stray, g),
        "broadcast_tensor": lambda: comm.broadcast_tensor(stray, 0, g),
        "exchange": lambda: comm.exchange([(stray, 1 - rank)], [], g),
        "all-gather": lambda: comm.gather_from_tp(stray, g),
        "reduce-scatter": lambda: comm.reduce_scatter_to_sp(stray, g),
        "all-reduce": lambda: comm.reduce_from_tp(stray, g),
    }
    for name, call in helpers.items():
        try:
            call()
        except RuntimeError as e:
            assert "on meta" in str(e) and "runs on cpu" in str(e), f"{name}: {e}"
        else:
            raise AssertionError(f"{name} took a tensor on meta for a group on the CPU")
    # The object collectives and the barrier build their own tensors on the group's device.
    assert comm.broadcast_object({"r": rank}, src=0, group=g) == {"r": 0}
    assert comm.all_gather_object(rank, g) == [0, 1]
    comm.barrier(g)
    return "ok"


def test_collectives_refuse_a_tensor_off_their_groups_device():
    assert run_ranks(_device_rule_worker, 2, timeout_s=60) == ["ok", "ok"]


def _snip_reduce_worker(rank: int, world: int) -> dict:
    from megatron_snip.snip.gather import reduce_snapshot

    topo = init_distributed(tp=world, pp=1, device_type="cpu", timeout_s=60)
    torch.set_default_device("meta")
    k = float(rank + 1)  # TP shards: the per-linear sums and the propagation pass add up over TP
    snapshot = {
        "linears": {"0.qkv": {"layer": 0, "linear": "qkv", "shape": [4, 8], "sq_w": 10 * k,
                              "per_format": {"fp8": {"err": k}}}},
        "propagation": {"0.qkv": {"num": k, "den": 2 * k}},
        "total_sq_update": 3 * k,
        "probe_sq_grad": 4 * k,
        "probe_loss_sum": 5.0,
    }
    return reduce_snapshot(snapshot, topo)


def test_snip_statistics_reduce_on_the_groups_device():
    """SNIP's statistics gather (the bug: a bare CPU ``torch.tensor`` all-reduced, which NCCL refuses
    at the first re-plan) builds its tensors on the topology's device: correct sums under a meta
    default device."""
    out = run_ranks(_snip_reduce_worker, 2, timeout_s=60)
    assert out[0] == out[1]
    lin = out[0]["linears"]["0.qkv"]
    assert lin["sq_w"] == 30.0 and lin["per_format"]["fp8"]["err"] == 3.0  # 1 + 2 over TP (dp = 1)
    assert out[0]["propagation"]["0.qkv"] == {"num": 3.0, "den": 6.0}
    assert out[0]["total_sq_update"] == 9.0 and out[0]["probe_sq_grad"] == 12.0 and out[0]["probe_loss_sum"] == 5.0
