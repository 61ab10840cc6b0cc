"""The Trainer under PP, DP and TP x PP on gloo vs the single-process Trainer, and resume.

Every run uses the same config and seed; the single-process reference runs in the test
process. Compared: per-step losses (the value every rank logs), the gradients of the first
step (after the DP/TP reduction, before clipping) and the weights after the last step, each
rank's against the matching slice (stage layers, TP shard) of the reference.

Tolerances (fp32, explained): a parallel layout changes only the order of fp32 sums (the
pipeline does not reorder anything inside a stage, DP averages two half-batch gradients,
TP sums partial GEMMs), so with BF16-plan numerics (= fp32 here) losses agree to 1e-6
relative and grads/weights to 1e-5 (measured: PP losses and grads bitwise equal, weights
7e-8 - the global norm is summed per stage; DP 1e-7; 1e-5 is gamma_K = K * 2**-24 for the
longest sums, K = 128). With a low-precision plan those ulp-level differences move values
across quantization boundaries - how many depends on the CPU's matmul blocking - so the TP x PP
run's drift is bounded in units of the quantization effect itself (quantization_noise.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_harness import run_ranks
from quantization_noise import MAX_RATIO, drift_ratio

from megatron_snip.config import load_config
from megatron_snip.model.layers import shard_state_dict
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.precision.plan import PrecisionPlan, all_gemm_ids
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
BASE = [
    "precision.compile_quantizers=false",  # eager: compiling per test shape would dominate the suite
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=2", "training.global_batch_size=8",
    "training.warmup_steps=1", "training.eval_batches=1", "training.eval_interval=1000", "training.log_interval=1",
    "training.progress=false", "snip.enabled=false", "data.valid_paths=[]",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("token_cache")  # tokenize the corpus once for the whole module


@pytest.fixture(scope="module")
def ref3(cache_dir, tmp_path_factory):
    """The single-process reference for the 3-step PP and DP comparisons (computed once)."""
    return _run(None, _overrides(cache_dir, tmp_path_factory.mktemp("ref3"), "training.max_steps=3"), 3)


def _init(overrides: list[str]):
    cfg = load_config(TINY, overrides)
    return init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=90)


def _run(topo, overrides: list[str], steps: int, save: bool = False, nan_on_dp_rank: int | None = None) -> dict:
    """Train ``steps`` steps, then optionally checkpoint (topo None: single process, no torch.distributed)."""
    tr = Trainer(load_config(TINY, overrides), topo)
    # Gradients of step 0 as the optimizer would see them (reduced over DP/TP), then start over.
    tr.optimizer.zero_grad(set_to_none=True)
    tr.forward_backward(tr.micro_batches(0))
    tr.grads.reduce()
    grads0 = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
    out = {"losses": [], "norms": []}
    for s in range(steps):
        res = tr.train_step(s)
        tr.step = s + 1
        assert not res.skipped
        out["losses"].append(res.loss)
        out["norms"].append(res.grad_norm)
    out.update(grads0=grads0, params={n: p.detach().clone() for n, p in tr.model.named_parameters()},
               spec=tr.model.tp_shard_spec(), tp=tr.topo.tp, tp_rank=tr.topo.tp_rank, pp_rank=tr.topo.pp_rank,
               dp_rank=tr.topo.dp_rank, needs_tokens=tr.batches.needs_tokens)
    if save:
        tr.save()
    if nan_on_dp_rank is not None:  # a non-finite loss on ONE replica must make every rank skip
        before = [p.detach().clone() for p in tr.model.parameters()]
        if tr.topo.dp_rank == nan_on_dp_rank:
            real = tr.model.loss  # the last stage's loss (every stage with pp=1)
            tr.model.loss = lambda logits, targets: real(logits, targets) * float("nan")
        res = tr.train_step(steps)
        out["nan_step_skipped"] = res.skipped
        out["nan_step_weights_kept"] = all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
    tr.logger.close()
    return out


def _worker(rank: int, world: int, overrides: list[str], steps: int, save: bool = False,
            nan_on_dp_rank: int | None = None) -> dict:
    return _run(_init(overrides), overrides, steps, save, nan_on_dp_rank)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(results: list[dict], ref: dict, *, loss_rtol: float, tensor_rtol: float) -> dict:
    worst = {"loss": 0.0, "grads0": 0.0, "params": 0.0}
    for r in results:
        for got, want in zip(r["losses"], ref["losses"]):
            worst["loss"] = max(worst["loss"], abs(got - want) / abs(want))
        for key in ("grads0", "params"):
            want = shard_state_dict({n: ref[key][n] for n in r[key]}, r["spec"], r["tp"], r["tp_rank"])
            for n, t in r[key].items():
                worst[key] = max(worst[key], _rel(t, want[n]))
    assert worst["loss"] <= loss_rtol, worst
    assert worst["grads0"] <= tensor_rtol and worst["params"] <= tensor_rtol, worst
    return worst


def _overrides(cache_dir, tmp_path, *extra):
    return BASE + [f"data.cache_dir={cache_dir}", f"training.run_dir={tmp_path / 'run'}", *extra]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_matches_pp1(cache_dir, tmp_path, ref3, schedule):
    over = _overrides(cache_dir, tmp_path, "training.max_steps=3")
    res = run_ranks(_worker, 2, args=(over + ["parallel.pp=2", f"parallel.pp_schedule={schedule}"], 3), timeout_s=90)
    assert [r["pp_rank"] for r in res] == [0, 1]
    assert res[0]["losses"] == res[1]["losses"], "the loss must be the same on every stage"
    _compare(res, ref3, loss_rtol=1e-6, tensor_rtol=1e-5)


def test_pp2_matches_pp1_under_bf16_autocast(cache_dir, tmp_path):
    """The residual stream runs in BF16 under autocast and travels between stages in BF16: the
    stages run the single process's ops on the same BF16 values, so losses and first-step
    gradients are the reference's (tolerances as in fp32: only the per-stage norm sums differ)."""
    over = BASE + [f"data.cache_dir={cache_dir}", "training.max_steps=2", "training.dtype=bfloat16"]
    ref = _run(None, over + [f"training.run_dir={tmp_path / 'pp1'}"], 2)
    res = run_ranks(_worker, 2, args=(over + ["parallel.pp=2", f"training.run_dir={tmp_path / 'pp2'}"], 2),
                    timeout_s=90)
    _compare(res, ref, loss_rtol=1e-6, tensor_rtol=1e-5)


def _pp4_worker(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    topo = _init(runs[0])
    return [_run(topo, over, 2) for over in runs]


def test_pp4_deep_pipeline_matches_pp1(cache_dir, tmp_path):
    """4 stages of one block each: 1F1B warm-up of 3 forwards on stage 0 with 4 micro-batches,
    and fewer micro-batches (2) than stages, where the steady phase is empty."""
    runs = [_overrides(cache_dir, tmp_path / f"r{m}", "model.num_layers=4", "training.max_steps=2",
                       f"training.micro_batch_size={8 // m}") for m in (4, 2)]
    refs = [_run(None, over, 2) for over in runs]
    # Own run directories: a fresh run into the references' ones would be refused (issue #17, item 2).
    res = run_ranks(_pp4_worker, 4, args=([over + ["parallel.pp=4", f"training.run_dir={tmp_path / f'pp4_{i}'}"]
                                           for i, over in enumerate(runs)],), timeout_s=120)
    for i, ref in enumerate(refs):
        _compare([r[i] for r in res], ref, loss_rtol=1e-6, tensor_rtol=1e-5)
        # the middle stages load no batch (data/device_batches.py); the first and last do
        assert [r[i]["needs_tokens"] for r in res] == [True, False, False, True]


def test_dp2_matches_dp1_with_the_same_global_batch(cache_dir, tmp_path, ref3):
    over = _overrides(cache_dir, tmp_path, "training.max_steps=3")
    res = run_ranks(_worker, 2, args=(over, 3, True, 1), timeout_s=90)  # world 2, tp=pp=1 -> dp=2
    assert [r["dp_rank"] for r in res] == [0, 1]
    assert res[0]["losses"] == res[1]["losses"] and res[0]["norms"] == res[1]["norms"]
    _compare(res, ref3, loss_rtol=1e-6, tensor_rtol=1e-5)
    # save(): only DP rank 0 writes the one (tp0, pp0) shard; meta records the layout
    step_dir = tmp_path / "run" / "checkpoints" / "step_000003"
    assert sorted(p.name for p in step_dir.iterdir()) == ["meta.json", "shard_tp00_pp00.pt"]
    assert json.loads((step_dir / "meta.json").read_text())["dp"] == 2
    # NaN guard: the NaN on DP rank 1 is seen by rank 0 too, and neither updates its weights
    assert all(r["nan_step_skipped"] and r["nan_step_weights_kept"] for r in res), res


def _plan_file(tmp_path, num_layers: int, fprop: str = "nvfp4") -> str:
    """NVFP4 forward, FP8 gradients: low precision without stochastic rounding (whose draws
    depend on the local shard shape, so no two layouts could agree)."""
    numel = linear_numel(model_linear_shapes(load_config(TINY, BASE).model))
    entries = {g: (fprop if g.gemm == "fprop" else "fp8") for g in all_gemm_ids(num_layers)}
    path = tmp_path / f"plan_{fprop}.json"
    path.write_text(PrecisionPlan.create(entries, numel, policy="test:nvfp4_fprop+fp8_grads").to_json())
    return str(path)


def _resume_worker(rank: int, world: int, overrides: list[str], run_a: str, run_b: str) -> dict:
    """TP=2 x PP=2: run A trains 4 steps; run B trains 2, saves, is rebuilt with resume=true and
    trains to 4. Returns rank 0's logged losses of both and run A's per-step results."""
    topo = _init(overrides)
    a = _run(topo, overrides + [f"training.run_dir={run_a}", "training.max_steps=4"], 4)
    tr = Trainer(load_config(TINY, overrides + [f"training.run_dir={run_b}", "training.max_steps=4"]), topo)
    for s in range(2):
        res = tr.train_step(s)
        tr.step = s + 1
        tr.logger.log_metrics(tr.step, {"loss": res.loss})
    tr.save()
    tr.logger.close()
    resumed = Trainer(load_config(TINY, overrides + [f"training.run_dir={run_b}", "training.max_steps=4",
                                                     "training.resume=true"]), topo)
    assert resumed.step == 2
    resumed.fit()
    resumed.logger.close()
    out = {"a": a}
    if rank == 0:
        with open(f"{run_b}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        out["b_losses"] = {r["step"]: r["loss"] for r in rows if "loss" in r}
    return out


def _drift(results: list[dict], ref: dict, ref_bf16: dict) -> dict:
    """Each rank's losses, first-step gradients and final weights against the matching slices of
    the low-precision reference, in units of that reference's quantization effect (its distance
    from the BF16 run): see quantization_noise.py."""
    out = {"loss": drift_ratio([torch.tensor(r["losses"]) for r in results],
                               [torch.tensor(ref["losses"])] * len(results),
                               [torch.tensor(ref_bf16["losses"])] * len(results))}
    for key in ("grads0", "params"):
        got, want, bf16 = [], [], []
        for r in results:
            names = list(r[key])
            got += [r[key][n] for n in names]
            for full, into in ((ref, want), (ref_bf16, bf16)):
                sliced = shard_state_dict({n: full[key][n] for n in names}, r["spec"], r["tp"], r["tp_rank"])
                into += [sliced[n] for n in names]
        out[key] = drift_ratio(got, want, bf16)
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_pp2_low_precision_trains_like_one_rank_and_resumes_exactly(cache_dir, tmp_path, sequence_parallel):
    plan = _plan_file(tmp_path, 2)
    over = BASE + [f"data.cache_dir={cache_dir}", f"precision.initial_plan={plan}", "training.save_interval=2"]
    ref = _run(None, over + [f"training.run_dir={tmp_path / 'ref'}", "training.max_steps=4"], 4)
    ref_bf16 = _run(None, over + [f"training.run_dir={tmp_path / 'bf16'}", "training.max_steps=4",
                                  "precision.initial_plan=bf16"], 4)
    par = over + ["parallel.tp=2", "parallel.pp=2", f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]
    res = run_ranks(_resume_worker, 4, args=(par, str(tmp_path / "a"), str(tmp_path / "b")), timeout_s=300)
    # The fp32 reordering of TP's partial sums may flip a few quantized values by one step, as
    # many as the CPU's matmul blocking puts near a rounding boundary: the drift is bounded in
    # units of the quantization effect (quantization_noise.py), not by a constant fitted here.
    worst = _drift([r["a"] for r in res], ref, ref_bf16)
    assert max(worst.values()) <= MAX_RATIO, worst
    # ... and the bound can fail: re-drawing the forward quantization (MXFP4's E8M0 32-blocks for
    # NVFP4's, as a sharding bug would re-draw it) puts the gradients and weights past it (measured
    # ~1.3; the 4 step losses are too few numbers for that: their quantization effects partly cancel).
    other = _run(None, BASE + [f"data.cache_dir={cache_dir}", f"precision.initial_plan={_plan_file(tmp_path, 2, 'mxfp4')}",
                               f"training.run_dir={tmp_path / 'mxfp4'}", "training.max_steps=4"], 4)
    redrawn = _drift([other], ref, ref_bf16)
    assert min(redrawn["grads0"], redrawn["params"]) > MAX_RATIO, redrawn
    assert len({tuple(r["a"]["losses"]) for r in res}) == 1, "all 4 ranks must log the same losses"
    # resume: bit-identical to the uninterrupted 4-rank run
    a_losses = {s + 1: v for s, v in enumerate(res[0]["a"]["losses"])}
    assert res[0]["b_losses"] == a_losses, (res[0]["b_losses"], a_losses, worst)
    # a checkpoint of another layout is resharded on load (losses: tests/distributed/test_resume_layout.py)
    one = Trainer(load_config(TINY, over + [f"training.run_dir={tmp_path / 'b'}", "training.max_steps=6",
                                            "training.resume=true"]))
    assert one.step == 4
    one.logger.close()
