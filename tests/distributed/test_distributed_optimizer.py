"""The ZeRO-1 distributed optimizer (training.distributed_optimizer) at DP=2 on gloo against the
unsharded AdamW at DP=2 (the same data split), all in one 2-rank job.

Exactness (fp32, explained): at DP=2 the reduce-scatter computes the same a+b (commutative,
exact) and /2 as the all-reduce, and AdamW's math is elementwise (torch's own kernel on a flat
shard), so with clipping off (grad_clip=0: coef exactly 1) losses, weights and SNIP statistics
are bitwise equal. With clipping on, the global norm is summed in another order (per shard,
then over DP), which moves the clip coefficient in the last bits: losses agree to 1e-6.

The gradient reduction overlapped with backward (training.overlap_grad_reduce), for the
distributed optimizer's reduce-scatter and for the plain all-reduce, against the same optimizer
reducing after backward: the same losses, gradient norms and weights, bit for bit (each
bucket's collective reduces the same finished gradients, only earlier), and the buckets really
start during backward. Small buckets (training.grad_bucket_mb) give about one parameter
per bucket, so the order in which buckets start and finish is exercised; two micro-batches per
rank, so a gradient is only final at its second accumulation; fp32 BF16 plan and BF16 autocast
with an NVFP4 plan (stochastic rounding in backward: the hooks must not disturb its draws).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_harness import run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.snip.stats import ProbeConfig, StatsCollector
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
BASE = [
    "precision.compile_quantizers=false",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=2", "training.global_batch_size=8",
    "training.warmup_steps=1", "training.eval_batches=1", "training.eval_interval=1000", "training.log_interval=1",
    "training.progress=false", "snip.enabled=false", "data.valid_paths=[]", "training.max_steps=4",
]
ZERO = ["training.distributed_optimizer=true"]


def _train(tr: Trainer, steps: range, norms: list[float] | None = None) -> list[float]:
    losses = []
    for s in steps:
        res = tr.train_step(s)
        tr.step = s + 1
        assert not res.skipped
        losses.append(res.loss)
        if norms is not None:
            norms.append(res.grad_norm)
    return losses


def _snapshot(tr: Trainer) -> dict:
    collector = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1))
    snap = collector.collect(tr, tr.micro_batches(tr.step)[:1], step=tr.step)
    snap.pop("timings")
    return snap


def _worker(rank: int, world: int, base: list[str], run_dir: str) -> dict:
    topo = init_distributed(1, 1, device_type="cpu", timeout_s=90)
    out: dict = {}
    runs = {}
    for name, extra in (("plain", []), ("zero", ZERO)):
        for clip in ("0", "1.0"):
            tr = Trainer(load_config(TINY, base + extra + [f"training.grad_clip={clip}",
                                                           f"training.run_dir={run_dir}/{name}{clip}"]), topo)
            out[f"{name}_clip{clip}"] = _train(tr, range(4))
            if clip == "0":
                runs[name] = tr
    plain, zero = runs["plain"], runs["zero"]
    out["params_equal"] = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), zero.model.parameters()))
    out["state_bytes"] = {"plain": sum(t.numel() * t.element_size() for st in plain.optimizer.state.values()
                                       for t in st.values()),
                          "zero": zero.optimizer.state_bytes()}
    # SNIP reads m and v: gathered over DP they equal the unsharded optimizer's state bit for bit.
    p0 = next(zero.model.parameters())
    full = zero.optimizer.full_state(p0)
    ref = plain.optimizer.state[next(plain.model.parameters())]
    out["full_state_equal"] = all(torch.equal(full[k], ref[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    out["snap_plain"], out["snap_zero"] = _snapshot(plain), _snapshot(zero)

    # Resume: B trains 2 steps with the distributed optimizer, saves, resumes and trains to 4.
    def resumed(first: list[str], then: list[str], name: str) -> list[float]:
        over = base + ["training.grad_clip=0", f"training.run_dir={run_dir}/{name}"]
        tr = Trainer(load_config(TINY, over + first), topo)
        losses = _train(tr, range(2))
        tr.save()
        tr.logger.close()
        tr = Trainer(load_config(TINY, over + then + ["training.resume=true"]), topo)
        assert tr.step == 2
        return losses + _train(tr, range(2, 4))

    out["zero_resumed"] = resumed(ZERO, ZERO, "resume_zero")
    out["plain_into_zero"] = resumed([], ZERO, "plain_into_zero")
    out["zero_into_plain"] = resumed(ZERO, [], "zero_into_plain")
    return out


def _run_on_two_ranks(tmp_path_factory, worker, run_dir_name: str, timeout_s: float):
    """``worker`` on 2 gloo ranks with the shared small config and a fresh token cache and run dir."""
    cache = tmp_path_factory.mktemp("token_cache")
    run_dir = tmp_path_factory.mktemp(run_dir_name)
    return run_ranks(worker, 2, args=(BASE + [f"data.cache_dir={cache}"], str(run_dir)), timeout_s=timeout_s)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run_on_two_ranks(tmp_path_factory, _worker, "runs", 240)


def test_losses_and_weights_match_the_unsharded_optimizer(results):
    for r in results:
        assert r["zero_clip0"] == r["plain_clip0"], "clipping off: bitwise equal losses"
        assert r["params_equal"]
        assert r["zero_clip1.0"] == pytest.approx(r["plain_clip1.0"], rel=1e-6, abs=0)
    assert results[0]["zero_clip1.0"] == results[1]["zero_clip1.0"], "every DP rank logs the same loss"


def test_optimizer_state_per_rank_is_half(results):
    for r in results:
        ratio = r["state_bytes"]["zero"] / r["state_bytes"]["plain"]
        assert abs(ratio - 0.5) <= 0.05 * 0.5, r["state_bytes"]


def test_snip_reads_the_sharded_state_like_the_unsharded_one(results):
    for r in results:
        assert r["full_state_equal"]
        assert r["snap_zero"]["linears"]["0.qkv"]["sq_v"] > 0, "the snapshot saw AdamW's v"
        assert r["snap_zero"] == r["snap_plain"]


def test_sharded_checkpoints_resume_exactly_and_convert_both_ways(results):
    for r in results:
        assert r["zero_resumed"] == r["zero_clip0"]
        assert r["plain_into_zero"] == r["plain_clip0"]
        assert r["zero_into_plain"] == r["plain_clip0"]


def _layout_worker(rank: int, world: int, base: list[str], run_dir: str, tp: int, pp: int) -> dict:
    """DP=2 with TP or PP: the shards' norm counts TP-sharded grads on both TP ranks, replicated
    ones once, and sums over the pipeline stages."""
    topo = init_distributed(tp, pp, device_type="cpu", timeout_s=90)
    out = {}
    for name, extra in (("plain", []), ("zero", ZERO)):
        tr = Trainer(load_config(TINY, base + extra + [f"training.run_dir={run_dir}/{name}"]), topo)
        out[f"{name}_norms"] = []
        out[name] = _train(tr, range(3), out[f"{name}_norms"])
        tr.logger.close()
    return out


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2_dp2_sp", "pp2_dp2"])
def test_model_parallel_x_dp2_matches_the_unsharded_optimizer(tmp_path, tp, pp):
    over = BASE + [f"data.cache_dir={tmp_path / 'cache'}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                   f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}"]
    res = run_ranks(_layout_worker, 4, args=(over, str(tmp_path), tp, pp), timeout_s=240)
    for r in res:
        assert r["zero_norms"] == pytest.approx(r["plain_norms"], rel=1e-6, abs=0)
        assert r["zero"] == pytest.approx(r["plain"], rel=1e-6, abs=0)


def _snip_worker(rank: int, world: int, base: list[str], run_dir: str) -> dict:
    """The whole SNIP re-plan (collect on every rank, reduce over DP, solve, broadcast) on top of
    the distributed optimizer: the same plans as with the unsharded one."""
    from megatron_snip.snip.controller import SnipController

    topo = init_distributed(1, 1, device_type="cpu", timeout_s=90)
    out = {}
    for name, extra in (("plain", []), ("zero", ZERO)):
        cfg = load_config(TINY, base + extra + [f"training.run_dir={run_dir}/{name}"])
        tr = Trainer(cfg, topo)
        tr.fit([SnipController(cfg, tr)])
        tr.logger.close()
        out[name] = [p.hash for p in tr.plan_history]
    return out


def test_snip_replans_on_the_distributed_optimizer(tmp_path):
    snip = ["snip.enabled=true", "snip.policy=snip", "snip.formats=[\"fp8\",\"nvfp4\"]", "snip.warmup=1",
            "snip.interval=2", "snip.probe_batches=1", "snip.noise_draws=1", "training.grad_clip=0"]
    res = run_ranks(_snip_worker, 2, args=(BASE + snip + [f"data.cache_dir={tmp_path / 'cache'}"], str(tmp_path)),
                    timeout_s=240)
    for r in res:
        assert len(r["plain"]) == 3 and r["zero"] == r["plain"]


# --- the gradient reduction overlapped with backward ---------------------------------------------
OVERLAP_SETTINGS = {"fp32": ["training.dtype=float32"],
                    "autocast_nvfp4": ["training.dtype=bfloat16", "precision.initial_plan=uniform:nvfp4"]}
OVERLAP_REDUCERS = {"zero": ZERO, "all_reduce": []}  # ZeRO-1's reduce-scatter; the plain DP all-reduce


def _overlap_worker(rank: int, world: int, base: list[str], run_dir: str) -> dict:
    topo = init_distributed(1, 1, device_type="cpu", timeout_s=90)
    out: dict = {}
    for (name, extra), (reducer, opt) in itertools.product(OVERLAP_SETTINGS.items(), OVERLAP_REDUCERS.items()):
        for overlap in (False, True):
            cfg = load_config(TINY, base + opt + extra + ["training.grad_bucket_mb=0.02",
                                                          f"training.overlap_grad_reduce={str(overlap).lower()}",
                                                          f"training.run_dir={run_dir}/{name}_{reducer}_{overlap}"])
            tr = Trainer(cfg, topo)
            norms: list[float] = []
            losses, launched = [], []
            for s in range(3):
                losses += _train(tr, range(s, s + 1), norms)
                launched.append(tr.grads.launched_in_backward)  # buckets the hooks started in this step
            tr.logger.close()
            out[name, reducer, overlap] = {"losses": losses, "norms": norms, "launched": launched,
                                           "buckets": len(tr.grads.bucket_params),
                                           "params": [p.detach().clone() for p in tr.model.parameters()]}
    return out


@pytest.fixture(scope="module")
def overlap_results(tmp_path_factory):
    return _run_on_two_ranks(tmp_path_factory, _overlap_worker, "overlap", 480)


@pytest.mark.parametrize("reducer", list(OVERLAP_REDUCERS))
@pytest.mark.parametrize("name", list(OVERLAP_SETTINGS))
def test_overlapped_reduction_is_bitwise_the_reduction_after_backward(overlap_results, name, reducer):
    for r in overlap_results:
        after, overlapped = r[name, reducer, False], r[name, reducer, True]
        assert overlapped["losses"] == after["losses"] and overlapped["norms"] == after["norms"]
        assert all(torch.equal(a, b) for a, b in zip(overlapped["params"], after["params"], strict=True))
        assert after["launched"] == [0, 0, 0]
        # Every bucket's gradients are finished inside the last backward pass (all parameters are
        # used), so the hooks start all of them; more than one bucket, so some start early.
        assert overlapped["buckets"] > 4 and overlapped["launched"] == [overlapped["buckets"]] * 3
