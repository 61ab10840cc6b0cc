"""TFLOP/s per device, MFU and peak memory in metrics.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.precision.capability import peak_bf16_tflops
from megatron_snip.training.throughput import Throughput
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"


def test_peak_table_matches_device_names():
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_bf16_tflops("NVIDIA GB200") == 2500.0 and peak_bf16_tflops("NVIDIA B200") == 2250.0
    assert peak_bf16_tflops("Tesla T4") is None


def test_model_flops_by_hand(small_overrides):
    cfg = load_config(TINY, small_overrides + ["training.global_batch_size=8"])  # 2 DP ranks x micro 4
    m, t = cfg.model, cfg.training
    d, f, hd, h, g, L, V = (m.hidden_size, m.ffn_hidden_size, m.head_dim, m.num_attention_heads, m.num_kv_heads,
                            m.num_layers, 320)
    T = t.global_batch_size * t.seq_len
    block_linears = (h + 2 * g) * hd * d + d * h * hd + 2 * f * d + d * f
    want = 6 * T * (L * block_linears + V * d) + 12 * T * t.seq_len * h * hd * L
    thr = Throughput(cfg, V, world_size=2, device=torch.device("cpu"))
    assert thr.flops_per_device == want / 2
    assert thr.peak_tflops is None and "mfu" not in thr.metrics(1.0)  # CPU: no known peak


def test_fit_logs_tflops_mfu_and_peak_memory(small_overrides, tmp_path):
    cfg = load_config(TINY, small_overrides + ["training.max_steps=2", "training.log_interval=1",
                                              "training.eval_interval=100", "logging.peak_tflops=0.5"])
    tr = Trainer(cfg)
    tr.fit()
    tr.logger.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["tflops_per_device"] == pytest.approx(tr.throughput.flops_per_device / r["step_time_s"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5)
        assert 0.01 < r["peak_memory_gib"] < 64  # this process's peak RSS: torch alone is > 10 MiB
