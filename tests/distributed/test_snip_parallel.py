"""Distributed SNIP on TP=2 x PP=2 (4 gloo ranks): statistics reduced to the whole model, one
plan solved on rank 0, broadcast, and applied with the same hash everywhere.

Exactness check: the fp8 forward error ‖e_Y‖² of the column-parallel linears (qkv, fc1) is a
sum over output shards, and fp8's tensor scale is made whole-tensor by the TP amax reduction,
so the reduced value must equal the single-process one - up to rounding flips: the parallel
run's activations differ from the single process's in the last fp32 bits (other summation
orders in the all-reduces, e.g. of the global gradient norm for clipping), and an element on an
fp8 rounding midpoint then rounds the other way. One such flip moved ‖e_Y‖² of 0.qkv by 1.1e-3
(64 probe tokens; ‖Q(X)-X‖² does not move, the two roundings being equally far), so the
tolerance is 1e-2: a lost or double-counted shard (-50%, +100%) still fails it.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.snip.controller import SnipController
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
BASE = [
    "precision.compile_quantizers=false",  # eager: compiling per test shape would dominate the suite
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=4", "training.global_batch_size=8",
    "training.warmup_steps=1", "training.eval_batches=1", "training.eval_interval=1000", "training.progress=false",
    "data.valid_paths=[]", "snip.enabled=true", "snip.policy=snip", "snip.formats=[\"fp8\",\"nvfp4\"]",
    "snip.warmup=1", "snip.interval=2", "snip.probe_batches=1", "snip.noise_draws=1", "training.max_steps=4",
]


def _train(topo, overrides):
    cfg = load_config(TINY, overrides)
    tr = Trainer(cfg, topo)
    ctl = SnipController(cfg, tr)
    snapshots = []
    real = ctl.replan

    def replan(host, step):
        outcome = real(host, step)
        snapshots.append(outcome.snapshot)
        return outcome

    ctl.replan = replan
    tr.fit([ctl])
    tr.logger.close()
    return {"hashes": [p.hash for p in tr.plan_history], "snapshots": snapshots, "rank": tr.topo.rank,
            "memory": ctl.cost_memory, "state": tr.extra_state["snip"].get("cost_memory"),
            "extra": [dict(p.extra).get("cost_ema") for p in tr.plan_history[1:]]}


def _worker(rank, world, overrides):
    cfg = load_config(TINY, overrides)
    return _train(init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=120), overrides)


def test_tp2_pp2_snip_replans_with_one_plan_everywhere(tmp_path):
    # A probe micro-batch smaller than the training one: the pipeline's p2p shapes follow the probe.
    common = BASE + [f"data.cache_dir={tmp_path / 'cache'}", "snip.probe_micro_batch_size=2"]
    ref = _train(None, common + [f"training.run_dir={tmp_path / 'ref'}"])
    par = run_ranks(_worker, 4, (common + [f"training.run_dir={tmp_path / 'par'}", "parallel.tp=2", "parallel.pp=2"],),
                    timeout_s=360)
    hashes = {tuple(r["hashes"]) for r in par}
    assert len(hashes) == 1, f"ranks hold different plans: {hashes}"
    assert len(next(iter(hashes))) == 3  # the initial bf16 plan + re-plans at steps 1 and 3
    for r in par:
        assert len(r["snapshots"]) == 2
        snap = r["snapshots"][0]
        assert sorted(snap["linears"]) == sorted(ref["snapshots"][0]["linears"])  # both stages' linears
        assert all(v["den"] > 0 and v["num"] > 0 for k, v in snap["propagation"].items() if k != "0.qkv")
        # The probe gradient's squared norm over the whole model (BF16 reference pass, no fp8 flips:
        # only the last fp32 bits move). A lost PP stage or lm_head shard moves it by percents (the
        # lm_head carried 28% of it at step 0 in this config); the norms' gains carry < 1e-4, so
        # their counting is not checked by this.
        assert snap["probe_sq_grad"] == pytest.approx(ref["snapshots"][0]["probe_sq_grad"], rel=1e-4)
        for key in ("0.qkv", "0.fc1", "1.qkv", "1.fc1"):
            got = snap["linears"][key]["per_format"]["fp8"]["sq_ey"]
            want = ref["snapshots"][0]["linears"][key]["per_format"]["fp8"]["sq_ey"]
            assert got == pytest.approx(want, rel=1e-2), key


def _propagation_worker(rank, world, overrides):
    from megatron_snip.snip.stats import ProbeConfig, StatsCollector

    cfg = load_config(TINY, overrides)
    tr = Trainer(cfg, init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=120))
    for step in range(2):
        tr.train_step(step)
    tokens = tr.micro_batches(5)[0]
    collector = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, propagation_sequences=2))
    by_vjp = collector.collect(tr, [tokens], step=3)["propagation"]
    collector._propagation_by_vjp = collector._propagation_by_reruns  # the path pipelined layouts take
    by_reruns = collector.collect(tr, [tokens], step=3)["propagation"]
    tr.logger.close()
    return by_vjp, by_reruns


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_propagation_by_vjp_equals_the_rerun_difference(tmp_path, sequence_parallel):
    """Under TP the vector-Jacobian product runs the same TP collectives as a whole backward:
    on every rank J·ε equals the difference of backward passes with and without ε."""
    overrides = BASE + [f"data.cache_dir={tmp_path / 'cache'}", f"training.run_dir={tmp_path / 'run'}",
                        "parallel.tp=2", f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
                        "snip.enabled=false"]
    for by_vjp, by_reruns in run_ranks(_propagation_worker, 2, (overrides,), timeout_s=240):
        assert sorted(by_vjp) == sorted(by_reruns)
        for key, got in by_vjp.items():
            assert got["den"] == by_reruns[key]["den"], key
            assert got["num"] == pytest.approx(by_reruns[key]["num"], rel=1e-3), key
        assert sum(v["num"] for v in by_vjp.values()) > 0


def _reuse_worker(rank, world, overrides):
    """Two trainers on one layout: one re-plans at step 2 reusing the reference pass for its step,
    the other trains step 2 in BF16; returns both one's parameters after step 2."""
    from megatron_snip.precision.plan import PrecisionPlan

    topo = None
    params, reused = [], []
    for reuse in ("true", "false"):
        cfg = load_config(TINY, overrides + [f"snip.reuse_step={reuse}", f"{overrides[-1]}{reuse}"])
        topo = topo or init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=120)
        tr = Trainer(cfg, topo)
        tr.train_step(0)
        tr.train_step(1)
        if reuse == "true":
            reused.append(SnipController(cfg, tr).replan(tr, 2).reused_micro_batches)
        else:
            tr.apply_plan(PrecisionPlan.create({g: "bf16" for g in tr.all_gemm_ids}, tr.linear_numel))
        tr.train_step(2)
        params.append([p.detach().clone() for p in tr.model.parameters()])
        tr.logger.close()
    return reused[0], params


@pytest.mark.parametrize("layout", [("parallel.pp=2", "training.overlap_grad_reduce=true"),
                                    ("training.distributed_optimizer=true",)])
def test_dp2_replan_step_reusing_its_reference_pass_is_a_bf16_step(tmp_path, layout):
    """snip.reuse_step under DP = 2 (with PP = 2 and the overlapped reduction, whose hooks then count
    no backward pass; or ZeRO-1): every rank reuses both its micro-batches (its probes are its own
    share of the step) and the update equals a BF16 step's bit for bit (M = 2 micro-batches)."""
    overrides = BASE + [f"data.cache_dir={tmp_path / 'cache'}", "training.micro_batch_size=2",
                        "snip.probe_batches=2", *layout, f"training.run_dir={tmp_path / 'run_'}"]
    world = 4 if "parallel.pp=2" in layout else 2
    for reused, (with_reuse, bf16) in run_ranks(_reuse_worker, world, (overrides,), timeout_s=360):
        assert reused == 2
        for a, b in zip(with_reuse, bf16):
            assert torch.equal(a, b)


def test_tp2_pp2_cost_memory_lives_on_rank_0_and_every_rank_applies_its_plan(tmp_path):
    """snip.cost_ema = 0.5 on TP=2 x PP=2: global rank 0, which solves, remembers 0.5 x (step 1's costs) +
    0.5 x (step 3's), each from the whole-model snapshot it reduced, and checkpoints that; the other ranks
    hold no memory (they never solve) and apply the same plans (one hash per re-plan everywhere)."""
    from megatron_snip.snip import cost_memory
    from megatron_snip.snip.policies import policy_costs

    overrides = BASE + [f"data.cache_dir={tmp_path / 'cache'}", f"training.run_dir={tmp_path / 'run'}",
                        "parallel.tp=2", "parallel.pp=2", "snip.cost_ema=0.5"]
    results = sorted(run_ranks(_worker, 4, (overrides,), timeout_s=360), key=lambda r: r["rank"])
    assert len({tuple(r["hashes"]) for r in results}) == 1 and len(results[0]["hashes"]) == 3
    rank0 = results[0]
    c1, c3 = (policy_costs("snip", s) for s in rank0["snapshots"])
    expected = {g: {f: 0.5 * c1[g][f] + 0.5 * c for f, c in per_f.items()} for g, per_f in c3.items()}
    assert rank0["memory"] == expected and cost_memory.from_state(rank0["state"]) == expected
    assert len(expected) == 2 * 4 * 3  # both stages' GEMMs
    assert rank0["extra"] == [0.5, 0.5]
    for r in results[1:]:
        assert r["memory"] is None and r["state"] is None
