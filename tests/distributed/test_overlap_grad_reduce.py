"""ZeRO-1 with the reduce-scatter overlapped with backward (training.overlap_grad_reduce) at DP=2
on gloo: the same losses, gradient norms and weights, bit for bit, as the reduction after
backward - each bucket's reduce-scatter reduces the same finished gradients, only earlier - and
the buckets really start during backward (the post-accumulate-grad hooks launched them).

Small buckets (training.grad_bucket_mb) give about one parameter per bucket, so the order in
which buckets start and finish is exercised; two micro-batches per rank, so a gradient is only
final at its second accumulation. Settings: fp32 BF16 plan, and BF16 autocast with an NVFP4 plan
(stochastic rounding in backward: the hooks must not disturb its draws).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
BASE = [
    "precision.compile_quantizers=false",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=2", "training.global_batch_size=8",
    "training.warmup_steps=1", "training.eval_batches=1", "training.eval_interval=1000", "training.log_interval=1",
    "training.progress=false", "snip.enabled=false", "data.valid_paths=[]", "training.max_steps=3",
    "training.distributed_optimizer=true", "training.grad_bucket_mb=0.02",
]
SETTINGS = {"fp32": ["training.dtype=float32"],
            "autocast_nvfp4": ["training.dtype=bfloat16", "precision.initial_plan=uniform:nvfp4"]}


def _worker(rank: int, world: int, run_dir: str) -> dict:
    topo = init_distributed(1, 1, device_type="cpu", timeout_s=90)
    out: dict = {}
    for name, extra in SETTINGS.items():
        for overlap in (False, True):
            cfg = load_config(TINY, BASE + extra + [f"training.overlap_grad_reduce={str(overlap).lower()}",
                                                    f"training.run_dir={run_dir}/{name}_{overlap}",
                                                    f"data.cache_dir={run_dir}/cache"])
            tr = Trainer(cfg, topo)
            losses, norms, launched = [], [], []
            for s in range(3):
                res = tr.train_step(s)
                tr.step = s + 1
                losses.append(res.loss)
                norms.append(res.grad_norm)
                launched.append(tr.grads.launched_in_backward)
            tr.logger.close()
            out[name, overlap] = {"losses": losses, "norms": norms, "launched": launched,
                                  "buckets": len(tr.grads.buckets),
                                  "params": [p.detach().clone() for p in tr.model.parameters()]}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, 2, args=(str(tmp_path_factory.mktemp("overlap")),), timeout_s=240)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_overlapped_reduce_scatter_is_bitwise_the_reduction_after_backward(results, name):
    for r in results:
        after, overlapped = r[name, False], r[name, True]
        assert overlapped["losses"] == after["losses"] and overlapped["norms"] == after["norms"]
        assert all(torch.equal(a, b) for a, b in zip(overlapped["params"], after["params"], strict=True))
        assert after["launched"] == [0, 0, 0]
        # Every bucket's gradients are finished inside the last backward pass (all parameters are
        # used), so the hooks start all of them; more than one bucket, so some start early.
        assert overlapped["buckets"] > 4 and overlapped["launched"] == [overlapped["buckets"]] * 3
