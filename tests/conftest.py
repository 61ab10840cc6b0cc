"""Shared fixtures: a very small model config that trains in seconds on the bundled sample."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")  # tests never talk to W&B unless they ask

SMALL = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=4", "training.global_batch_size=4",
    "training.warmup_steps=2", "training.eval_batches=2", "training.progress=false", "snip.enabled=false",
    "data.valid_paths=[]",
    # Eager quantizers: each test model has its own shapes, and compiling kernels for them would
    # dominate the suite (compiled == eager is tested in test_quantize.py).
    "precision.compile_quantizers=false",
]


@pytest.fixture
def small_overrides(tmp_path):
    """Overrides for a 2-layer d=64 model writing into a fresh run dir and data cache."""
    return SMALL + [f"training.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
