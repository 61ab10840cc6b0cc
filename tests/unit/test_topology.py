"""Topology: Megatron rank order, group enumeration, layout validation, init from torchrun's env."""

from __future__ import annotations

import os
import socket

import pytest

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import (
    cuda_device_index,
    destroy_distributed,
    env_world_size,
    init_distributed,
)
from megatron_snip.parallel.pipeline import run_no_pipeline, schedule_for
from megatron_snip.parallel.topology import (
    ParallelTopology,
    TensorParallel,
    check_layout,
    group_ranks,
    stage_of_layer,
)

LAYOUTS = [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2), (8, 2, 2), (8, 2, 1), (8, 1, 4), (16, 2, 4), (12, 3, 2)]


def test_megatron_order_for_8_ranks_tp2_pp2():
    g = group_ranks(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    t = ParallelTopology.from_rank(8, 6, tp=2, pp=2)
    assert (t.tp_rank, t.dp_rank, t.pp_rank, t.dp) == (0, 1, 1, 2)
    assert t.stage_rank(0) == 2 and t.is_last_stage and not t.is_first_stage


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_groups_partition_the_world_and_match_coords(world, tp, pp):
    dp = world // (tp * pp)
    groups = group_ranks(world, tp, pp)
    sizes = {"tp": tp, "pp": pp, "dp": dp, "mp": tp * pp}
    for kind, lists in groups.items():
        flat = sorted(r for lst in lists for r in lst)
        assert flat == list(range(world)), kind
        assert all(len(lst) == sizes[kind] for lst in lists), kind
    for rank in range(world):
        t = ParallelTopology.from_rank(world, rank, tp, pp)
        assert ParallelTopology.rank_of(t.tp_rank, t.pp_rank, t.dp_rank, tp, dp) == rank
        coords = {r: ParallelTopology.coords(r, tp, pp, dp) for r in range(world)}
        same = {  # the members of each of this rank's groups share the other coordinates
            "tp": {r for r, (_, p, d) in coords.items() if (p, d) == (t.pp_rank, t.dp_rank)},
            "pp": {r for r, (a, _, d) in coords.items() if (a, d) == (t.tp_rank, t.dp_rank)},
            "dp": {r for r, (a, p, _) in coords.items() if (a, p) == (t.tp_rank, t.pp_rank)},
            "mp": {r for r, (_, _, d) in coords.items() if d == t.dp_rank},
        }
        for kind, members in same.items():
            mine = [lst for lst in groups[kind] if rank in lst]
            assert len(mine) == 1 and set(mine[0]) == members, (kind, rank)


def test_stage_layers_even_split():
    t = ParallelTopology.from_rank(4, 3, tp=1, pp=4)
    assert list(t.stage_layers(8)) == [6, 7]
    assert [list(t.stage_layers(8, p)) for p in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"model.num_layers=6 .*parallel.pp=4"):
        t.stage_layers(6)


def test_stage_of_layer_is_the_topologys_split():
    """The per-stage plan constraints and the model's stages use one split."""
    t = ParallelTopology.from_rank(4, 0, tp=1, pp=4)
    assert stage_of_layer(8, 4) == {layer: p for p in range(4) for layer in t.stage_layers(8, p)}
    assert stage_of_layer(8, 1) is None
    with pytest.raises(ValueError, match=r"model.num_layers=6 .*parallel.pp=4"):
        stage_of_layer(6, 4)


def test_one_stage_runs_the_no_pipeline_schedule():
    assert schedule_for(ParallelTopology.single(), "1f1b") is run_no_pipeline
    assert schedule_for(ParallelTopology.from_rank(2, 0, tp=1, pp=2), "gpipe") is not run_no_pipeline
    with pytest.raises(ValueError, match="parallel.pp_schedule='zb'"):
        schedule_for(ParallelTopology.single(), "zb")


@pytest.mark.parametrize("world,tp,pp,words", [
    (6, 4, 1, ["parallel.tp*parallel.pp=4", "world size 6"]),
    (4, 0, 1, ["parallel.tp=0", ">= 1"]),
    (0, 1, 1, ["world size 0"]),
])
def test_impossible_layouts_are_value_errors(world, tp, pp, words):
    with pytest.raises(ValueError) as e:
        check_layout(world, tp, pp)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("overrides,world,words", [
    (["parallel.tp=4", "model.num_kv_heads=2"], 4, ["model.num_kv_heads", "2", "parallel.tp=4"]),
    (["parallel.tp=2", "model.ffn_hidden_size=765"], 2, ["model.ffn_hidden_size", "765", "parallel.tp=2"]),
    (["parallel.tp=8"], 8, ["model.num_attention_heads", "4", "parallel.tp=8"]),
    (["parallel.pp=3"], 3, ["model.num_layers", "4", "parallel.pp=3"]),
    (["parallel.tp=2", "parallel.pp=2"], 6, ["parallel.tp*parallel.pp", "world size 6"]),
])
def test_config_rejects_layouts_the_model_cannot_split(overrides, world, words):
    with pytest.raises(ValueError) as e:
        load_config("launch/configs/tiny.toml", overrides).validate(world)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_tensor_parallel_view_validation():
    assert TensorParallel().size == 1
    with pytest.raises(ValueError, match="rank"):
        TensorParallel(size=2, rank=2)
    with pytest.raises(ValueError, match="sequence_parallel"):
        TensorParallel(sequence_parallel=True)
    t = ParallelTopology.from_rank(4, 1, tp=2, pp=1).tensor_parallel(sequence_parallel=True)
    assert (t.size, t.rank, t.sequence_parallel) == (2, 1, True)


def test_init_distributed_needs_torchrun_env():
    with pytest.raises(ValueError, match=r"MASTER_ADDR.*torchrun"):
        init_distributed(1, 1, env={"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        env_world_size({"WORLD_SIZE": "two"})
    assert env_world_size({}) == 1


def test_init_distributed_single_rank_gloo():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        topo = init_distributed(1, 1, device_type="cpu", timeout_s=30, env=env)
        assert (topo.world_size, topo.tp, topo.pp, topo.dp, topo.rank) == (1, 1, 1, 1, 0)
        assert topo.tp_group is not None and topo.world_group is not None
        assert topo.device == "cpu"
    finally:
        destroy_distributed()


@pytest.mark.parametrize("local_rank,count,index", [(0, 8, 0), (5, 8, 5), (5, 1, 0), (3, 1, 0), (6, 4, 2)])
def test_cuda_device_index_is_local_rank_mod_visible_gpus(local_rank, count, index):
    # (5, 1): a scheduler that gives each task one GPU shows it as cuda:0 whatever LOCAL_RANK is.
    assert cuda_device_index(local_rank, count) == index


def test_cuda_device_index_without_a_gpu_says_so():
    with pytest.raises(ValueError, match=r"sees no GPU.*training.device=cpu"):
        cuda_device_index(0, 0)


class _Recorder:
    """Stands in for the CUDA/NCCL calls of ``init_distributed`` (none exist on this machine)."""

    def __init__(self) -> None:
        self.calls: dict[str, object] = {}

    def init_process_group(self, backend, **kwargs):
        self.calls["init"] = (backend, kwargs, os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    def new_subgroups_by_enumeration(self, ranks):
        return f"group{ranks}", []


@pytest.mark.parametrize("preset", [None, "3"])
def test_init_distributed_on_nccl_binds_the_gpu_and_lets_the_watchdog_end_the_process(monkeypatch, preset):
    """The NCCL path as far as it runs without a GPU: one GPU visible to a task whose LOCAL_RANK is 5
    (a scheduler's one-GPU-per-task launch) -> cuda:0, made current and bound to every group
    (``device_id``: eager communicators, the device ``comm.group_device`` reads); the async error
    handling set to tear down before the process group exists, unless the environment chose one."""
    import torch
    import torch.distributed as dist

    rec = _Recorder()
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", preset or "unset")  # restored after the test
    if preset is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: rec.calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", rec.init_process_group)
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", rec.new_subgroups_by_enumeration)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    topo = init_distributed(1, 2, device_type="cuda", timeout_s=30, env=env)
    backend, kwargs, handling = rec.calls["init"]
    assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 0)
    assert rec.calls["set_device"] == torch.device("cuda", 0)
    assert handling == (preset or "1")
    assert topo.device == "cuda:0" and topo.pp_rank == 1 and topo.pp_group == "group[[0, 1]]"
