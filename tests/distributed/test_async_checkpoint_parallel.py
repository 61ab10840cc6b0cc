"""``training.async_save`` on two ranks (TP=2, gloo): the commit waits for every rank's writer.

Each rank writes its TP shard in a background thread; rank 0 commits only after the agreement (an
all-reduce of "busy"/"failed" flags on the main thread at a log/eval/save step). Here rank 1's
writer is slow (it sleeps with its shard half-written): a commit on rank 0's own writer alone would
record a checkpoint without ``shard_tp01_pp00.pt`` (``checkpoint.verify`` at tp=2 refuses it). A
writer that fails on rank 1 stops both ranks, each naming the checkpoint. The async run also
profiles two steps (``training.profile_steps``): a trace per rank, the same numbers."""

from __future__ import annotations

import json
import time

import torch
from dist_harness import SMALL_MULTI_RANK, TINY, run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.telemetry.profile import trace_path
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.trainer import Trainer

BASE = [*SMALL_MULTI_RANK, "parallel.tp=2", "training.max_steps=6", "training.save_interval=2",
        "training.keep_checkpoints=5", "precision.initial_plan=uniform:nvfp4"]


def _worker(rank: int, world: int, overrides: list[str], mode: str) -> dict:
    cfg = load_config(TINY, overrides)
    tr = Trainer(cfg, init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=300))
    if mode != "sync" and rank == 1:
        def hook(point: str, step: int) -> None:
            if point == "partial" and mode == "slow":
                time.sleep(1.5)  # several steps of this model: rank 0's writer is long done
            if point == "partial" and mode == "fail" and step == 4:
                raise OSError("disk full (test)")
        tr.saver.hook = hook
    try:
        tr.fit()
        return {"outcome": "finished", "step": tr.step}
    except ckpt.CheckpointError as e:
        return {"outcome": str(e), "step": tr.step}
    finally:
        tr.logger.close()


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_the_commit_waits_for_the_slow_rank_and_equals_the_synchronous_run(tmp_path):
    sync, slow = tmp_path / "sync", tmp_path / "async"
    run_ranks(_worker, 2, (BASE + [f"training.run_dir={sync}"], "sync"), timeout_s=300)
    # Steps 3-4 profiled too: one trace per rank, and no change to the numbers (compared below).
    out = run_ranks(_worker, 2, (BASE + [f"training.run_dir={slow}", "training.async_save=true",
                                         "training.profile_steps=[3,4]"], "slow"), timeout_s=300)
    for rank in (0, 1):
        names = {e["name"] for e in json.loads(trace_path(slow, rank).read_text())["traceEvents"]}
        assert {"step:3", "step:4", "gemm:fprop:nvfp4", "quantize:nvfp4:weight"} <= names, (rank, sorted(names)[:20])
    assert [o["outcome"] for o in out] == ["finished", "finished"]
    root = slow / "checkpoints"
    assert ckpt.list_checkpoints(root) == [2, 4, 6]
    for step in (2, 4, 6):
        meta = ckpt.verify(root, step, tp=2, pp=1)  # both TP shards, each matching its sha256
        assert sorted(meta["shards"]) == ["shard_tp00_pp00.pt", "shard_tp01_pp00.pt"]
        for tp_rank in (0, 1):
            a = ckpt.read_shard(root, step, tp_rank)["model"]
            b = ckpt.read_shard(sync / "checkpoints", step, tp_rank)["model"]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(slow) == _losses(sync)


def test_a_writer_failing_on_one_rank_stops_both_naming_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    out = run_ranks(_worker, 2, (BASE + [f"training.run_dir={run}", "training.async_save=true"], "fail"),
                    timeout_s=300)
    where = ckpt.tmp_dir(run / "checkpoints", 4)
    assert f"async checkpoint of step 4 ({where}) failed on 1 other rank(s)" in out[0]["outcome"], out
    assert f"async checkpoint of step 4 ({where}) failed on rank 1: OSError: disk full (test)" in out[1]["outcome"], out
    # Both stop at the same step: the agreement's after step 5 if rank 1's writer had failed by then, else
    # the final save's wait after step 6 (threads' timing decides which; never a rank going on alone).
    assert out[0]["step"] == out[1]["step"] in (5, 6), out
    assert ckpt.list_checkpoints(run / "checkpoints") == [2]
