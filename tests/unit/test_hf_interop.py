"""Hugging Face Llama import/export (interop/hf.py) against transformers' own LlamaForCausalLM.

Every HF model here is a small random one built and saved with ``save_pretrained`` inside the
test (GQA: 4 heads / 2 KV heads, untied head unless stated). Its weights are re-drawn with a
larger spread (and non-unit norm weights) so logits differ by O(1) between tokens and a wrong
mapping cannot hide under the tolerance.

Tolerance: our fp32 forward and HF's do the same operations in the same order except the
attention kernel (both SDPA, possibly different paths) and RoPE's cos/sin from an outer product
vs a matmul; logits agree within 4x the reference's own fp32-vs-fp64 distance
(tests/hf_tolerance.py says why; 0 difference on the development machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file

from megatron_snip.interop import hf
from megatron_snip.model.llama import LlamaModel
from megatron_snip.parallel.topology import TensorParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_tiny_hf
from hf_tolerance import logits_atol

VOCAB = 128


def _spread(model, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        if model.config.tie_word_embeddings:
            model.tie_weights()


def _hf_model(tmp_path: Path, name: str = "hf", **kw) -> tuple[Path, torch.nn.Module]:
    model = make_tiny_hf.tiny_llama(VOCAB, **kw)
    _spread(model)
    out = tmp_path / name
    model.save_pretrained(out)
    return out, model


def _import(hf_dir: Path) -> LlamaModel:
    cfg, vocab, _ = hf.model_config_from_hf(hf.read_hf_config(hf_dir))
    ours = LlamaModel(cfg, vocab, seed=0)
    hf.load_into_model(ours, hf_dir)
    return ours.eval()


def _tokens(n: int = 100) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["plain", "llama3_rope", "tied"])
def test_import_logits_equal_transformers(tmp_path, kind):
    kw = {"plain": {}, "tied": {"tie": True},
          "llama3_rope": {"rope_scaling": make_tiny_hf.LLAMA3_SCALING, "rope_theta": 500000.0}}[kind]
    hf_dir, ref = _hf_model(tmp_path, **kw)
    ours = _import(hf_dir)
    if kind == "llama3_rope":
        assert ours.cfg.rope_scaling == "llama3" and ours.cfg.rope_original_max_position == 64
    x = _tokens()  # 100 positions > the 64 of llama3's original context: all three frequency bands used
    with torch.no_grad():
        want, got = ref(x).logits, ours(x)
    assert want.std() > 0.5  # the weights' spread makes the comparison meaningful
    torch.testing.assert_close(got, want, atol=logits_atol(ref, x), rtol=0)


def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    hf_dir, _ = _hf_model(tmp_path)
    ours = _import(hf_dir)
    with torch.no_grad():  # move away from the imported weights: the export must carry ours
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tensors, tied = hf.hf_state_dict(ours.state_dict(), ours.cfg)
    assert not tied
    hf.save_hf(tmp_path / "out", tensors, hf.hf_config_from_model(ours.cfg, VOCAB, tie_word_embeddings=tied,
                                                                   dtype=torch.float32))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=logits_atol(back, x), rtol=0)


@pytest.mark.parametrize("kw", [{}, {"tie": True, "rope_scaling": make_tiny_hf.LLAMA3_SCALING}],
                         ids=["untied", "tied_llama3"])
def test_import_export_import_is_bit_exact(tmp_path, kw):
    hf_dir, _ = _hf_model(tmp_path, **kw)
    ours = _import(hf_dir)
    tensors, tied = hf.hf_state_dict(ours.state_dict(), ours.cfg)
    assert tied == bool(kw.get("tie"))
    hf_cfg = hf.hf_config_from_model(ours.cfg, VOCAB, tie_word_embeddings=tied, dtype=torch.float32)
    # 40 KB files: the sharded layout with model.safetensors.index.json
    files = hf.save_hf(tmp_path / "b", tensors, hf_cfg, max_shard_bytes=40_000)
    assert hf.SAFETENSORS_INDEX in files and len(files) > 3
    a = load_file(hf_dir / "model.safetensors")
    b = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(tmp_path / "b" / f).items()}
    if tied:
        a.pop("lm_head.weight", None)  # transformers may or may not write the tied copy
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    again = _import(tmp_path / "b")
    for (n, p), (_, q) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), n
    assert hf.model_config_from_hf(hf.read_hf_config(tmp_path / "b")) == hf.model_config_from_hf(hf.read_hf_config(hf_dir))
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "b").eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(_tokens()).logits, again(_tokens()), atol=logits_atol(ref, _tokens()), rtol=0)


def test_tp_shards_read_only_their_slices(tmp_path):
    """Each TP rank's read equals its slice of the unsharded import (the layout the model uses)."""
    hf_dir, _ = _hf_model(tmp_path)
    full = _import(hf_dir).state_dict()
    cfg, vocab, _ = hf.model_config_from_hf(hf.read_hf_config(hf_dir))
    for rank in range(2):
        shard = LlamaModel(cfg, vocab, tp=TensorParallel(size=2, rank=rank), seed=0)
        hf.load_into_model(shard, hf_dir)
        want = shard.sharded_state_dict(full)
        for name, t in shard.state_dict().items():
            assert torch.equal(t, want[name]), (rank, name)


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 32}, "head_dim=32"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "rope_parameters": None}, "rope type 'yarn'"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
])
def test_unsupported_configs_are_refused(change, message):
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": VOCAB}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        hf.model_config_from_hf({**base, **change})


def test_legacy_rope_keys_read_like_rope_parameters():
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": VOCAB}
    legacy = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **{k: v for k, v in
                                                                               make_tiny_hf.LLAMA3_SCALING.items()
                                                                               if k != "rope_type"}}}
    new = {**base, "rope_parameters": {"rope_theta": 5e5, **make_tiny_hf.LLAMA3_SCALING}}
    assert hf.model_config_from_hf(legacy) == hf.model_config_from_hf(new)
    assert hf.model_config_from_hf(new)[0].rope_base == 5e5


def test_hf_config_json_round_trips_through_transformers(tmp_path):
    hf_dir, _ = _hf_model(tmp_path, rope_scaling=make_tiny_hf.LLAMA3_SCALING, rope_theta=500000.0)
    cfg, vocab, tied = hf.model_config_from_hf(hf.read_hf_config(hf_dir))
    written = hf.hf_config_from_model(cfg, vocab, tie_word_embeddings=tied, dtype=torch.float32)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(written))
    loaded = transformers.LlamaConfig.from_pretrained(tmp_path / "c")
    assert hf.model_config_from_hf(loaded.to_dict())[0] == cfg


def test_bf16_checkpoint_imports_to_fp32_and_exports_back_bit_exact(tmp_path):
    model = make_tiny_hf.tiny_llama(VOCAB)
    _spread(model)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ours = _import(tmp_path / "bf16")
    assert ours.embedding.weight.dtype == torch.float32
    tensors, _ = hf.hf_state_dict(ours.state_dict(), ours.cfg, torch.bfloat16)
    original = load_file(tmp_path / "bf16" / "model.safetensors")
    for k, t in tensors.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, original[k]), k


def test_directory_without_safetensors_is_refused_with_the_fix(tmp_path):
    hf_dir, _ = _hf_model(tmp_path)
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")  # an old-style checkpoint
    assert hf.is_hf_dir(hf_dir)
    with pytest.raises(ValueError, match=r"has no \*.safetensors files .* safe_serialization=True"):
        hf.HFCheckpointReader(hf_dir)
