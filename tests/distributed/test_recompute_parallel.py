"""Activation recompute under TP=2 x PP=2 with sequence parallelism (4 gloo ranks): the
recomputed forward repeats the block's TP collectives (SP all-gather, row-parallel
reduce-scatter, fp8/nvfp4 amax all-reduces) in backward on every TP rank alike, so losses
are bitwise those without recompute (same layout, fp32 on CPU; see tests/unit/test_recompute.py)."""

from __future__ import annotations

from dist_harness import run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
BASE = [
    "precision.compile_quantizers=false",
    "model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=2", "training.global_batch_size=8",
    "training.warmup_steps=1", "training.eval_batches=1", "training.eval_interval=1000", "training.log_interval=1",
    "training.progress=false", "snip.enabled=false", "data.valid_paths=[]", "training.max_steps=3",
    "precision.initial_plan=uniform:nvfp4", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
]


def _worker(rank: int, world: int, base: list[str], run_dir: str) -> dict[str, list[float]]:
    topo = init_distributed(2, 2, device_type="cpu", timeout_s=90)
    out = {}
    for mode in ("none", "selective", "full"):
        tr = Trainer(load_config(TINY, base + [f"training.recompute={mode}", f"training.run_dir={run_dir}/{mode}"]), topo)
        losses = []
        for s in range(3):
            res = tr.train_step(s)
            tr.step = s + 1
            losses.append(res.loss)
        out[mode] = losses
        tr.logger.close()
    return out


def test_tp2_pp2_sp_recompute_is_bitwise_identical(tmp_path):
    res = run_ranks(_worker, 4, args=(BASE + [f"data.cache_dir={tmp_path / 'cache'}"], str(tmp_path)), timeout_s=240)
    for r in res:
        assert r["selective"] == r["none"] and r["full"] == r["none"], r
    assert len({tuple(r["none"]) for r in res}) == 1, "every rank logs the same losses"
