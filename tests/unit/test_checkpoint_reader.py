"""The shared checkpoint reader (training/checkpoint_reader.py, issue #36 item 1): evaluate,
training.init_from, the HF export and the reshard script verify each shard's sha256 before use
(naming the shard), refuse non-finite weights (naming the tensor), and from a run directory fall
back to the newest checkpoint that verifies, saying which one they used."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL

from megatron_snip import evaluate
from megatron_snip.config import load_config
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.checkpoint_reader import open_checkpoint
from megatron_snip.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import convert_hf
import reshard_checkpoint

TINY = "launch/configs/tiny.toml"
BAD_TENSOR = "layers.0.mlp.fc1.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("reader")
    tr = Trainer(load_config(TINY, SMALL + [f"training.run_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}",
                                            "training.max_steps=4", "training.save_interval=2",
                                            "training.eval_interval=100"]))
    tr.fit()
    tr.logger.close()
    return tmp / "run"


@pytest.fixture
def run(pristine, tmp_path):
    """A fresh copy of the run (each test damages its own)."""
    dst = tmp_path / "run"
    shutil.copytree(pristine, dst)
    return dst


def nan_weights(run: Path, step: int, *, fix_checksum: bool) -> Path:
    """Write NaN into BAD_TENSOR of shard (tp0, pp0) of checkpoint ``step``; with ``fix_checksum``
    the manifest is updated too (weights a diverged run saved: the sha256 matches)."""
    d = ckpt.step_dir(run / "checkpoints", step)
    shard = d / ckpt.shard_name()
    state = torch.load(shard, weights_only=True)
    state["model"][BAD_TENSOR][0, 0] = float("nan")
    torch.save(state, shard)
    if fix_checksum:
        meta = json.loads((d / "meta.json").read_text())
        meta["shards"][shard.name] = ckpt.file_sha256(shard)
        (d / "meta.json").write_text(json.dumps(meta))
    return d


def _eval(*args: str) -> int:
    return evaluate.main(["--checkpoint", *args, "--valid-corpus", "moby=bundled:moby_dick", "--max-sequences", "4",
                          "--no-held-out"])


def test_evaluate_falls_back_past_a_checksum_failing_checkpoint_and_says_which(run, capsys):
    d4 = nan_weights(run, 4, fix_checksum=False)
    assert _eval(str(run)) == 0
    captured = capsys.readouterr()
    d2 = ckpt.step_dir(run / "checkpoints", 2)
    assert f"using checkpoint {d2} (step 2, the newest that verifies); skipped 1 newer" in captured.err, captured.err
    assert f"{d4}: shard shard_tp00_pp00.pt is corrupt (sha256" in captured.err
    assert "loss nan" not in captured.out and f"checkpoint {d2} step 2" in captured.out, captured.out
    assert d4.is_dir()  # a reader sets nothing aside


def test_evaluate_refuses_a_named_checkpoint_whose_shard_fails_its_checksum(run, capsys):
    d4 = nan_weights(run, 4, fix_checksum=False)
    assert _eval(str(d4)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --checkpoint="), err
    assert "shard shard_tp00_pp00.pt is corrupt" in err
    assert f"give {ckpt.step_dir(run / 'checkpoints', 2)} (the newest checkpoint of the run that verifies)" in err


def test_evaluate_refuses_non_finite_weights_naming_the_tensor(run, capsys):
    d4 = nan_weights(run, 4, fix_checksum=True)
    assert _eval(str(d4)) == 2
    err = capsys.readouterr().err
    assert f"tensor {BAD_TENSOR} (256, 64) holds 1 non-finite value(s)" in err, err
    assert "shard_tp00_pp00.pt" in err and "use an older checkpoint" in err


def test_evaluate_result_names_the_checkpoint_it_read(run, tmp_path):
    out = tmp_path / "e.json"
    assert _eval(str(run), "--out", str(out)) == 0
    assert json.loads(out.read_text())["checkpoint"] == str(ckpt.step_dir(run / "checkpoints", 4))


@pytest.mark.parametrize("fix_checksum, words", [(False, "shard shard_tp00_pp00.pt is corrupt (sha256"),
                                                  (True, f"tensor {BAD_TENSOR} (256, 64) holds 1 non-finite")])
def test_export_refuses_a_bad_checkpoint_and_writes_nothing(run, tmp_path, capsys, fix_checksum, words):
    d4 = nan_weights(run, 4, fix_checksum=fix_checksum)
    out = tmp_path / "hf"
    assert convert_hf.main(["export", str(d4), "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert words in err[-1] and err[-1].startswith("error: "), err  # one error line (after the "note:" lines)
    assert all(line.startswith("note: ") for line in err[:-1]), err
    assert not out.exists() or not any(out.iterdir())


def test_export_of_a_run_directory_uses_the_newest_verified_and_warns_about_the_byte_tokenizer(run, tmp_path,
                                                                                              capsys):
    nan_weights(run, 4, fix_checksum=False)
    out = tmp_path / "hf"
    assert convert_hf.main(["export", str(run), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "using checkpoint" in err and "(step 2, the newest that verifies)" in err, err
    assert "data.tokenizer='byte'" in err and "lm_eval" in err and "no tokenizer files are written" in err
    assert json.loads((out / "megatron_snip_plans.json").read_text())["step"] == 2


@pytest.mark.parametrize("fix_checksum, words", [(False, "shard shard_tp00_pp00.pt is corrupt (sha256"),
                                                  (True, f"tensor {BAD_TENSOR} (256, 64) holds 1 non-finite")])
def test_init_from_refuses_a_bad_checkpoint_naming_the_source(run, tmp_path, fix_checksum, words):
    d4 = nan_weights(run, 4, fix_checksum=fix_checksum)
    cfg = load_config(TINY, SMALL + [f"training.run_dir={tmp_path / 'new'}", f"data.cache_dir={tmp_path / 'c'}",
                                     f"training.init_from={d4}", "training.max_steps=2"])
    with pytest.raises(ValueError) as e:
        Trainer(cfg)
    assert words in str(e.value) and str(d4) in str(e.value), e.value
    assert not (tmp_path / "new" / "config.toml").exists()  # a refused source leaves no run behind


def test_init_from_a_run_directory_says_which_checkpoint_it_used(run, tmp_path, capsys):
    nan_weights(run, 4, fix_checksum=False)
    cfg = load_config(TINY, SMALL + [f"training.run_dir={tmp_path / 'new'}", f"data.cache_dir={tmp_path / 'c'}",
                                     f"training.init_from={run}", "training.max_steps=2"])
    tr = Trainer(cfg)
    tr.logger.close()
    out = capsys.readouterr().out
    assert "initialized weights from" in out and "(step 2, the newest that verifies); skipped 1 newer" in out, out


def test_reshard_script_refuses_a_non_finite_checkpoint(run, tmp_path, capsys):
    d4 = nan_weights(run, 4, fix_checksum=True)
    assert reshard_checkpoint.main([str(d4), "--tp", "2", "--pp", "1", "--out", str(tmp_path / "b")]) == 2
    assert f"tensor {BAD_TENSOR}" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_resume_refuses_non_finite_weights_naming_the_tensor(run):
    nan_weights(run, 4, fix_checksum=True)
    cfg = load_config(TINY, SMALL + [f"training.run_dir={run}", f"data.cache_dir={run.parent / 'c'}",
                                     "training.max_steps=6", "training.resume=true"])
    with pytest.raises(ckpt.CheckpointError, match=rf"tensor {BAD_TENSOR} \(256, 64\) holds 1 non-finite"):
        Trainer(cfg)


def test_a_hugging_face_directory_without_config_json_is_named_as_such(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"looks like a Hugging Face model directory \(it has model.safetensors\) "
                                         r"but has no config.json; copy the model's config.json"):
        open_checkpoint(hf_dir, "config training.init_from")


def test_init_from_a_non_finite_source_names_the_field_the_source_and_the_tensor(run, tmp_path):
    d4 = nan_weights(run, 4, fix_checksum=True)
    cfg = load_config(TINY, SMALL + [f"training.run_dir={tmp_path / 'new'}", f"data.cache_dir={tmp_path / 'c'}",
                                     f"training.init_from={d4}", "training.max_steps=2"])
    with pytest.raises(ckpt.CheckpointError) as e:
        Trainer(cfg)
    assert str(e.value).startswith(f"config training.init_from='{d4}': checkpoint {d4}: shard shard_tp00_pp00.pt: "
                                   f"tensor {BAD_TENSOR} (256, 64) holds 1 non-finite"), e.value
