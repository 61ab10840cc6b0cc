"""Bad Hugging Face inputs and unwritable outputs (issue #26, section 2): each ends in one
message naming the file or tensor, the value and the fix, and writes nothing half-done."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_snip.config import load_config
from megatron_snip.data.tokenizer import ByteTokenizer
from megatron_snip.interop import hf
from megatron_snip.model.llama import LlamaModel, pad_vocab
from megatron_snip.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import convert_hf

TINY = "launch/configs/tiny.toml"


@pytest.fixture(scope="module")
def good_hf(tmp_path_factory):
    """An HF directory of the conftest.SMALL architecture with the byte tokenizer's vocabulary,
    written by our own exporter (no transformers needed)."""
    from conftest import SMALL

    cfg = load_config(TINY, SMALL)
    model = LlamaModel(cfg.model, pad_vocab(ByteTokenizer().vocab_size), seed=3)
    tensors, tied = hf.hf_state_dict(model.state_dict(), cfg.model)
    out = tmp_path_factory.mktemp("hf") / "good"
    hf.save_hf(out, tensors, hf.hf_config_from_model(cfg.model, model.vocab_size, tie_word_embeddings=tied,
                                                      dtype=torch.float32))
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _init(small_overrides, hf_dir, *extra):
    return Trainer(load_config(TINY, [*small_overrides, f"training.init_from={hf_dir}", *extra]))


def test_good_hf_dir_loads(small_overrides, good_hf):
    tr = _init(small_overrides, good_hf)
    assert torch.equal(tr.model.embedding.weight, load_file(good_hf / hf.SINGLE_FILE)["model.embed_tokens.weight"])
    tr.logger.close()


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_unreadable_safetensors_name_the_file(small_overrides, good_hf, tmp_path, damage):
    bad = _copy(good_hf, tmp_path / "hf")
    f = bad / hf.SINGLE_FILE
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncated" else data[:8] + b"#" + data[9:])
    with pytest.raises(ValueError, match=rf"{f}.*(truncated or corrupt).*download or save it again"):
        _init(small_overrides, bad)


def test_integer_hf_tensors_are_refused(small_overrides, good_hf, tmp_path):
    bad = _copy(good_hf, tmp_path / "hf")
    tensors = load_file(bad / hf.SINGLE_FILE)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int64)
    save_file(tensors, str(bad / hf.SINGLE_FILE))
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' has dtype I64, not a float"):
        _init(small_overrides, bad)


def test_unused_hf_tensors_are_named_and_refused_unless_ignored(small_overrides, good_hf, tmp_path):
    bad = _copy(good_hf, tmp_path / "hf")
    tensors = load_file(bad / hf.SINGLE_FILE)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(64)
    save_file(tensors, str(bad / hf.SINGLE_FILE))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) map to no parameter.*'model.layers.0.self_attn.q_proj.bias'"
                                         r".*training.init_from_ignore_unused=true"):
        _init(small_overrides, bad)
    _init(small_overrides, bad, "training.init_from_ignore_unused=true").logger.close()


def test_invalid_hf_config_json_names_the_file(small_overrides, good_hf, tmp_path):
    bad = _copy(good_hf, tmp_path / "hf")
    (bad / hf.CONFIG_FILE).write_text("{'hidden_size': 64}")
    msg = rf"{bad / hf.CONFIG_FILE} is not valid JSON .*restore the model's config.json"
    with pytest.raises(ValueError, match=msg):
        _init(small_overrides, bad)
    with pytest.raises(ValueError, match=msg):
        convert_hf.hf_training_config(str(bad), TINY, [])


def _convert(capsys, *argv) -> tuple[int, str]:
    code = convert_hf.main(list(argv))
    return code, capsys.readouterr().err


def test_convert_hf_unwritable_outputs_are_errors_not_tracebacks(good_hf, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, err = _convert(capsys, "config", str(good_hf), "--out", str(tmp_path / "missing" / "train.toml"))
    assert code == 2 and "--out" in err and "missing" in err and "does not exist" in err, err
    code, err = _convert(capsys, "config", str(good_hf), "--out", str(blocker / "train.toml"))
    assert code == 2 and "is a file, not a directory" in err, err
    run = tmp_path / "run"
    code, err = _convert(capsys, "export", str(run), "--out", str(blocker))
    assert code == 2 and f"--out {blocker}" in err and "is a file" in err, err


def test_convert_hf_refuses_a_non_positive_shard_size(good_hf, tmp_path, capsys):
    code, err = _convert(capsys, "export", str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--max-shard-gb", "-1")
    assert code == 2 and "--max-shard-gb=-1.0" in err and "positive" in err, err
    assert not (tmp_path / "o").exists()
