"""Dry-run sizing checked against hand calculations done here, independently of sizing/.

The 70B figures use the published Llama-2-70B parameter count and the per-rank arithmetic
written out number by number (TP=8, PP=8, DP=1 on 64 GPUs, micro 1 x 4096, global 1024).
"""

from __future__ import annotations

import pytest

from megatron_snip import sizing
from megatron_snip.config import load_config

CFG_70B = "launch/configs/llama_70b.toml"
GIB = 1024**3

# Llama-2-70B: d=8192, ffn=28672, 64 heads of 128, 8 kv heads, 80 blocks, vocab 32000.
LINEARS_PER_BLOCK = 8192 * (64 + 2 * 8) * 128 + 8192 * 8192 + 2 * 28672 * 8192 + 28672 * 8192
NORMS_PER_BLOCK = 2 * 8192
LLAMA2_70B_PARAMS = 68_976_648_192  # the published count (Touvron et al. 2023, HF config)
TOKENS_PER_STEP = 1024 * 4096
# The Blackwell candidate set (the shipped 70B config targets Hopper: bf16 + fp8_block under a time budget).
FP4_SET = ['snip.target="fp4_share"', "snip.fp4_target=0.75", 'snip.formats=["fp8", "nvfp4"]']


@pytest.fixture(autouse=True)
def _default_gpu(monkeypatch):
    monkeypatch.delenv(sizing.GPU_ENV, raising=False)


@pytest.fixture(scope="module")
def s70():
    # The shipped config runs Transformer Engine: these tests check its support table too, with the
    # Blackwell candidate set.
    return sizing.estimate(load_config(CFG_70B, FP4_SET), 64)


def test_70b_layout_and_parameter_count(s70):
    assert (s70.tp, s70.pp, s70.dp, s70.layers_per_stage, s70.micro_batches) == (8, 8, 1, 10, 1024)
    assert LINEARS_PER_BLOCK == 855_638_016
    assert s70.params_total == LLAMA2_70B_PARAMS
    assert s70.params_total == 80 * (LINEARS_PER_BLOCK + NORMS_PER_BLOCK) + 2 * 32000 * 8192 + 8192
    # Per rank: a TP shard of 10 blocks (norms replicated) + the vocab-parallel embedding / LM head shard.
    blocks_per_rank = 10 * (LINEARS_PER_BLOCK // 8 + NORMS_PER_BLOCK)
    assert blocks_per_rank == 1_069_711_360
    first, last = s70.stages[0], s70.stages[-1]
    assert first.params == blocks_per_rank + 4000 * 8192 == 1_102_479_360
    assert last.params == blocks_per_rank + 4000 * 8192 + 8192
    assert (first.first_layer, first.last_layer, last.first_layer, last.last_layer) == (0, 9, 70, 79)


def test_parameter_counts_match_the_model_built_on_meta():
    """The sizing arithmetic against the real LlamaModel (meta device: shapes only, no memory)."""
    import torch

    from megatron_snip.model.llama import LlamaModel, count_parameters

    cfg = load_config(CFG_70B)
    with torch.device("meta"):
        full = LlamaModel(cfg.model, 32000)
        first_stage = LlamaModel(cfg.model, 32000, layers=range(10), pre_process=True, post_process=False)
    assert count_parameters(full) == LLAMA2_70B_PARAMS
    s70 = sizing.estimate(cfg, 64)
    assert s70.stages[0].params * 8 == count_parameters(first_stage) + 7 * 10 * NORMS_PER_BLOCK  # norms replicated


def test_70b_memory_per_rank(s70):
    first, last = s70.stages[0], s70.stages[-1]
    # 4 B fp32 master weight + 4 B fp32 grad + 8 B Adam m, v (DP=1: nothing to shard anyway).
    assert first.weight_bytes == 4 * 1_102_479_360
    assert first.grad_bytes == 4 * 1_102_479_360
    assert first.optimizer_bytes == 8 * 1_102_479_360
    # BF16 autocast, BF16 plan, SP over TP=8, as the code saves (sizing.activation_bytes): everything
    # BF16; the norms' inputs (the residual stream's sequence shard) 2*2d/8 = 4096, the gathered
    # qkv and fc1 inputs 2*2d = 32768, attention (2*(h+2g)*hd + 4h + 2*h*hd)/8 = 37120/8 = 4640,
    # SwiGLU (fc1's output and fc2's input) 6f/8 = 21504.
    assert s70.activation_bytes_per_token_layer == 4_096 + 32_768 + 4_640 + 21_504 == 63_008
    # Autocast's BF16 weight copies: 2 B per local linear parameter, once per step (shared by the micro-batches).
    copies = 2 * LINEARS_PER_BLOCK // 8
    assert s70.activations.weight_copies_per_block == copies
    # 1F1B: the first stage holds pp = 8 micro-batches of its 10 blocks, 4096 tokens each.
    assert first.in_flight == 8 and last.in_flight == 1
    assert first.activation_bytes == 8 * 10 * 4096 * 63_008 + 10 * copies
    # Last stage: one micro-batch + LM head (the final norm's BF16 input shard 2d/8, its BF16 output
    # 2d gathered for the head, fp32 softmax 4*V/8, int64 targets 8; the head weight's BF16 copy 2*V*d/8).
    head = 2 * 8192 // 8 + 2 * 8192 + 4 * 32000 // 8 + 8
    assert last.activation_bytes == 10 * (4096 * 63_008 + copies) + 4096 * head + 2 * 32000 * 8192 // 8
    assert first.total_bytes == 16 * 1_102_479_360 + 8 * 10 * 4096 * 63_008 + 10 * copies
    assert s70.peak_stage.stage == 0
    assert 37 * GIB < first.total_bytes < 38 * GIB  # fits an 80 GiB H100, 42 GiB left for probes and buffers


def test_70b_flops(s70):
    non_embedding = LLAMA2_70B_PARAMS - 32000 * 8192 - (2 * 80 + 1) * 8192  # LM head counts, embedding and norms don't
    attention = 12 * TOKENS_PER_STEP * 4096 * 64 * 128 * 80  # 4*T*s*h*hd forward, twice that backward, per block
    assert s70.flops_total == 6 * TOKENS_PER_STEP * non_embedding + attention
    assert s70.flops["fc1.wgrad"] == 2 * TOKENS_PER_STEP * 8192 * (2 * 28672) * 80
    assert s70.flops["qkv.fprop"] == s70.flops["qkv.dgrad"] == s70.flops["qkv.wgrad"]
    assert s70.flops["lm_head.dgrad"] == 2 * TOKENS_PER_STEP * 8192 * 32000
    assert s70.flops["attention.bwd"] == 2 * s70.flops["attention.fwd"]
    assert s70.flops_linear == 6 * TOKENS_PER_STEP * 80 * LINEARS_PER_BLOCK
    # Every GPU does 1/64 of the block work; the last stage adds the LM head.
    assert s70.stages[0].flops == (s70.flops_total - 3 * s70.flops["lm_head.fprop"]) // 8 // 8
    assert s70.stages[-1].flops > s70.stages[0].flops


def test_70b_snip_problem_and_gpu_support(s70):
    sn = s70.snip
    assert (sn.units, sn.booleans) == (80 * 4, 80 * 4 * 2)  # layer granularity, fp8 + nvfp4 everywhere
    assert sn.constraints == 320 + 1 + 8  # exactly-one per unit, global FP4 floor, one floor per stage
    assert sn.max_fp4_share == 1.0
    assert s70.gpu.name == "H100"
    assert s70.support["fp8"][0] and s70.support["bf16"][0]
    ok, why = s70.support["nvfp4"]
    assert not ok and "Blackwell" in why and "emulated" in why
    b200 = sizing.estimate(load_config(CFG_70B, FP4_SET), 64, gpu="b200")
    assert all(ok for ok, _ in b200.support.values())


def test_gpu_from_environment(monkeypatch):
    monkeypatch.setenv(sizing.GPU_ENV, "GB200")
    assert sizing.resolve_gpu().name == "GB200"
    monkeypatch.setenv(sizing.GPU_ENV, "v100")
    with pytest.raises(ValueError, match="MEGATRON_SNIP_GPU"):
        sizing.resolve_gpu()


def test_dry_run_cli_prints_report_without_process_group(capsys):
    import torch.distributed as dist

    from megatron_snip.train import main

    assert main(["--config", CFG_70B, "--dry-run", "--world-size", "64",
                 *(a for ov in FP4_SET for a in ("--set", ov))]) == 0
    out = capsys.readouterr().out
    for text in ("68,976,648,192", "TP 8 x PP 8 x DP 1", "10 blocks per stage", "640 Booleans", "329 constraints",
                 "nvfp4     NO"):
        assert text in out, text
    assert not dist.is_initialized()


@pytest.mark.parametrize("name,world", [("llama_3b", 8), ("llama_7b", 16), ("llama_70b", 64)])
def test_multi_gpu_configs_run_transformer_engine_per_shard(name, world):
    """The shipped TP configs name TE with what it supports under TP: per-shard amaxes, one recipe per
    linear. The dry run accepts them and refuses what TE would refuse at start-up, with the fix."""
    cfg = load_config(f"launch/configs/{name}.toml")
    assert cfg.parallel.tp > 1
    assert (cfg.precision.backend, cfg.precision.tp_amax, cfg.snip.granularity) == ("te", "shard", "layer")
    s = sizing.estimate(cfg, world, gpu="b200")
    assert s.backend == "te" and all(ok for ok, _ in s.support.values())
    with pytest.raises(ValueError, match=r"\['fp8', 'nvfp4'\] have a tensor scale.*precision.tp_amax=\"shard\""):
        sizing.estimate(load_config(f"launch/configs/{name}.toml", [*FP4_SET, "precision.tp_amax=tensor"]), world)
    with pytest.raises(ValueError, match='set snip.granularity="layer"'):
        sizing.estimate(load_config(f"launch/configs/{name}.toml", ["snip.granularity=gemm"]), world)
    sizing.estimate(load_config(f"launch/configs/{name}.toml", ["precision.tp_amax=tensor", "precision.backend=torch",
                                                                "snip.granularity=gemm"]), world)


def test_world_size_is_validated():
    cfg = load_config(CFG_70B)
    with pytest.raises(ValueError, match="parallel.tp"):
        sizing.estimate(cfg, 48)  # 48 is not a multiple of tp*pp = 64
    with pytest.raises(ValueError, match="world_size"):
        sizing.estimate(cfg, 0)


def test_in_flight_micro_batches_follow_the_schedule():
    one_f_one_b = sizing.estimate(load_config(CFG_70B, ["training.global_batch_size=4"]), 64)
    assert [s.in_flight for s in one_f_one_b.stages] == [4, 4, 4, 4, 4, 3, 2, 1]  # min(pp - stage, m), m = 4
    gpipe = sizing.estimate(load_config(CFG_70B, ["training.global_batch_size=4", "parallel.pp_schedule=gpipe"]), 64)
    assert [s.in_flight for s in gpipe.stages] == [4] * 8
    no_sp = sizing.estimate(load_config(CFG_70B, ["parallel.sequence_parallel=false"]), 64)
    assert no_sp.activation_bytes_per_token_layer == 2 * 2 * 8192 + 32_768 + 4_640 + 21_504  # norms not /8


def test_block_divisibility_limits_candidates():
    # 3B at TP=2: every local dim (4800, 3200, 1600, 8640, 4320) is a multiple of 16 but none of 128.
    s3 = sizing.estimate(load_config("launch/configs/llama_3b.toml", ["snip.formats=[\"fp8_block\", \"nvfp4\"]"]), 8)
    assert s3.snip.allowed == {"fp8_block": 0, "nvfp4": 26 * 4}
    # Per-GEMM units, MXFP4 (32-blocks): fc2's K=80 breaks fprop, 40 tokens break every wgrad.
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=96", "model.num_attention_heads=2",
                             "model.num_kv_heads=1", "model.ffn_hidden_size=80", "training.seq_len=40",
                             "training.micro_batch_size=1", "training.global_batch_size=1", "snip.granularity=gemm",
                             "snip.formats=[\"fp8\", \"mxfp4\"]"])
    s = sizing.estimate(cfg, 1)
    assert s.snip.units == 2 * 12 and s.snip.allowed == {"fp8": 24, "mxfp4": 2 * (3 + 4)}
    numel = {"qkv": 192 * 96, "proj": 96 * 96, "fc1": 160 * 96, "fc2": 96 * 80}
    reachable = 2 * numel["qkv"] + 2 * numel["proj"] + 2 * numel["fc1"] + 1 * numel["fc2"]
    assert s.snip.max_fp4_share == pytest.approx(reachable / (3 * sum(numel.values())))


def test_fp32_activations_and_tiny_report():
    tiny = sizing.estimate(load_config("launch/configs/tiny.toml", ["training.dtype=float32"]), 1)
    d, f, h, g, hd = 256, 768, 4, 2, 64
    # fp32: norm inputs 8d + linear inputs 8d; RoPE'd q, k and v's copy 4(h+2g)hd + 4h + output 4h*hd; 12f
    assert tiny.activation_bytes_per_token_layer == 16 * d + 4 * (h + 2 * g) * hd + 4 * h + 4 * h * hd + 12 * f
    assert tiny.activations.weight_copies_per_block == 0  # fp32: no autocast copies
    assert tiny.vocab_size == 320 and tiny.params_total == 3_311_872  # "tiny: a 3.3M-parameter Llama"
    text = sizing.dry_run_report(load_config("launch/configs/tiny.toml"), 1)
    assert "emulated" in text and "NO " not in text


def test_formats_of_a_plan_file_are_checked_against_the_backend(tmp_path):
    from megatron_snip.precision.plan import PrecisionPlan

    plan_path = tmp_path / "plan.json"
    plan_path.write_text(PrecisionPlan.uniform("mxfp4", 80, {"qkv": 1, "proj": 1, "fc1": 1, "fc2": 1}).to_json())
    s = sizing.estimate(load_config(CFG_70B, [f"precision.initial_plan={plan_path}", "snip.enabled=false"]), 64,
                        gpu="b200")
    assert s.formats_used == ("bf16", "mxfp4")
    assert s.support["mxfp4"][0] is False and "no Transformer Engine recipe" in s.support["mxfp4"][1]
    with pytest.raises(ValueError, match="does not exist"):
        sizing.estimate(load_config(CFG_70B, [f"precision.initial_plan={tmp_path / 'nope.json'}"]), 64)


def test_70b_recompute_and_distributed_optimizer():
    """The dry run per setting, from the same formulas tests/unit/test_activation_memory.py measures."""
    def first_stage(*over, world=64):
        return sizing.estimate(load_config(CFG_70B, list(over)), world).stages[0]

    none = first_stage()
    selective = first_stage("training.recompute=selective")
    full = first_stage("training.recompute=full")
    assert selective.activation_bytes < none.activation_bytes
    # full: each block keeps its BF16 input 2d/8 per token (SP); no weight copies are kept.
    assert full.activation_bytes == 8 * 10 * 4096 * (2 * 8192 // 8)
    assert full.activation_bytes < 0.15 * none.activation_bytes
    half = first_stage("training.recompute=full", "training.recompute_every=2")
    assert half.activation_bytes == (none.activation_bytes + full.activation_bytes) // 2
    # The distributed optimizer shards m and v over DP; at DP=1 (64 GPUs) there is nothing to shard.
    assert first_stage("training.distributed_optimizer=true").optimizer_bytes == none.optimizer_bytes
    dp2 = first_stage("training.distributed_optimizer=true", "training.global_batch_size=1024", world=128)
    assert dp2.optimizer_bytes == 8 * 1_102_479_360 // 2
