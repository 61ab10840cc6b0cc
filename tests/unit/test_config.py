"""Config loading: TOML + overrides, and a clear ValueError for every kind of bad input."""

from __future__ import annotations

import pytest
import torch

from megatron_snip.config import Config, load_config
from megatron_snip.model.llama import LlamaModel, count_parameters

CONFIGS = "launch/configs"


def test_tiny_loads_and_round_trips(tmp_path):
    cfg = load_config(f"{CONFIGS}/tiny.toml", ["training.max_steps=7", "snip.formats=[\"fp8\",\"mxfp4\"]",
                                                "precision.initial_plan=uniform:nvfp4"])
    assert cfg.training.max_steps == 7 and cfg.snip.formats == ("fp8", "mxfp4")
    assert cfg.precision.initial_plan == "uniform:nvfp4"
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg


@pytest.mark.parametrize("name,published", [
    ("llama_1b", 1.10e9), ("llama_3b", 3.43e9), ("llama_7b", 6.74e9), ("llama_70b", 68.98e9)])
def test_parameter_counts_match_published(name, published):
    cfg = load_config(f"{CONFIGS}/{name}.toml")
    with torch.device("meta"):
        model = LlamaModel(cfg.model, cfg.model.vocab_size)
    n = count_parameters(model)
    assert abs(n - published) / published < 0.01, f"{name}: {n / 1e9:.3f}B vs published {published / 1e9:.2f}B"


BAD = [
    # (overrides, world_size, words the message must contain)
    (["model.hidden_size=250"], 1, ["model.hidden_size", "250", "num_attention_heads"]),
    (["model.num_kv_heads=3"], 1, ["model.num_attention_heads", "num_kv_heads=3"]),
    (["model.num_layers=0"], 1, ["model.num_layers", "0", "> 0"]),
    (["training.seq_len=4096"], 1, ["training.seq_len", "4096", "max_position_embeddings"]),
    (["training.global_batch_size=12"], 1, ["training.global_batch_size", "12", "micro_batch_size"]),
    (["training.lr_schedule=linear"], 1, ["training.lr_schedule", "linear", "cosine"]),
    (["training.min_lr=1.0"], 1, ["training.min_lr", "1.0"]),
    (["training.beta2=1.5"], 1, ["training.beta2", "1.5"]),
    (["training.dtype=fp16"], 1, ["training.dtype", "fp16", "bfloat16"]),
    (["training.max_stepz=3"], 1, ["training.max_stepz", "unknown key"]),
    (["trainng.max_steps=3"], 1, ["trainng", "unknown config section"]),
    (["training.max_steps=abc"], 1, ["training.max_steps", "abc", "integer"]),
    (["snip.fp4_target=1.5"], 1, ["snip.fp4_target", "1.5", "[0, 1]"]),
    (["snip.probe_micro_batch_size=-1"], 1, ["snip.probe_micro_batch_size", "-1", ">= 0"]),
    (["snip.enabled=true", "snip.probe_micro_batch_size=2", "snip.propagation_sequences=3"], 1,
     ["snip.propagation_sequences", "3", "2 sequences"]),
    (["snip.granularity=block"], 1, ["snip.granularity", "block", "layer"]),
    (["snip.formats=[\"fp8\",\"fp6\"]"], 1, ["snip.formats", "fp6", "choose from"]),
    (["snip.formats=[\"fp8\"]", "snip.fp4_target=0.5"], 1, ["snip.fp4_target", "no FP4 format", "nvfp4"]),
    (["precision.backend=cuda"], 1, ["precision.backend", "cuda", "emulated"]),
    (["precision.tp_amax=whole"], 1, ["precision.tp_amax", "whole", "shard"]),
    (["parallel.tp=3"], 3, ["model.num_attention_heads", "parallel.tp=3"]),
    (["parallel.pp=3"], 3, ["model.num_layers", "parallel.pp=3"]),
    (["parallel.tp=2"], 3, ["parallel.tp*parallel.pp", "world size 3"]),
    (["parallel.sequence_parallel=true"], 1, ["parallel.sequence_parallel", "tp > 1"]),
    (["data.tokenizer=wordpiece"], 1, ["data.tokenizer", "wordpiece", "byte"]),
    (["data.split=100"], 1, ["data.split", "100", "train,valid"]),
    (["logging.wandb_mode=cloud"], 1, ["logging.wandb_mode", "cloud", "offline"]),
    (["training.max_steps"], 1, ["section.field=value"]),
]


@pytest.mark.parametrize("overrides,world,words", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_is_a_clear_value_error(overrides, world, words):
    with pytest.raises(ValueError) as exc:
        load_config(f"{CONFIGS}/tiny.toml", overrides).validate(world)
    for w in words:
        assert w in str(exc.value), f"message {str(exc.value)!r} lacks {w!r}"


def test_missing_config_file_and_bad_toml(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nnum_layers = 2")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_defaults_are_valid():
    assert Config().validate(1) is not None
