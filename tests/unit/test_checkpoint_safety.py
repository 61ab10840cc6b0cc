"""Checkpoints an adversary, a crash or a changed config hands to ``training.resume`` (issue #17, items 1-4, 11)."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest

from megatron_snip.config import load_config
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(overrides, *extra):
    tr = Trainer(load_config(TINY, overrides + list(extra)))
    tr.fit()
    tr.logger.close()
    return tr


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


class _Payload:
    """Unpickling this runs a shell command (what a hostile shard does)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_shard_is_refused_and_runs_nothing(small_overrides, tmp_path):
    common = ["training.max_steps=2", "training.log_interval=1"]
    train(small_overrides, *common)
    root = tmp_path / "run" / "checkpoints"
    shard = ckpt.step_dir(root, 2) / ckpt.shard_name()
    marker = tmp_path / "pwned"
    shard.write_bytes(pickle.dumps({"model": _Payload(marker)}))
    # The adversary can rewrite the checksum too: weights_only must refuse the payload by itself.
    meta = json.loads((shard.parent / "meta.json").read_text())
    meta["shards"][shard.name] = ckpt.file_sha256(shard)
    (shard.parent / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"shard_tp00_pp00.pt cannot be loaded safely .*weights_only=True"):
        Trainer(load_config(TINY, small_overrides + ["training.max_steps=4", "training.resume=true"]))
    assert not marker.exists(), "unpickling the shard ran its payload"


def test_fresh_run_into_a_run_directory_is_refused(small_overrides, tmp_path):
    train(small_overrides, "training.max_steps=3")
    before = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    with pytest.raises(ValueError, match=r"training.run_dir=.*already holds a run \(metrics.jsonl, config.toml, "
                                         r"checkpoints up to step 3\) and training.resume=false; .*resume=auto"):
        Trainer(load_config(TINY, small_overrides + ["training.max_steps=4", "training.save_interval=2"]))
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == before == [3]


def _corrupt_flip(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    ("flip", r"shard_tp00_pp00.pt is corrupt \(sha256"),
    ("truncate", r"shard_tp00_pp00.pt is corrupt \(sha256"),
    ("empty", r"shard_tp00_pp00.pt is corrupt \(sha256 .* size 0 bytes"),
    ("missing", r"incomplete: shard shard_tp00_pp00.pt listed in meta.json is missing"),
    ("meta", r"meta.json is unreadable \(JSONDecodeError"),
])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(small_overrides, tmp_path, damage, reason,
                                                                  capsys):
    common = ["training.log_interval=1", "training.eval_interval=100", "training.save_interval=2",
              "training.keep_checkpoints=3"]
    train(small_overrides, *common, "training.max_steps=6")
    run = tmp_path / "run"
    # Reference: the same run resumed from step 4 (step 6 removed by hand).
    ref_dir = tmp_path / "ref"
    shutil.copytree(run, ref_dir)
    shutil.rmtree(ckpt.step_dir(ref_dir / "checkpoints", 6))
    ref_over = [o for o in small_overrides if not o.startswith("training.run_dir")] + [f"training.run_dir={ref_dir}"]
    train(ref_over, *common, "training.max_steps=8", "training.resume=true")

    d6 = ckpt.step_dir(run / "checkpoints", 6)
    shard = d6 / ckpt.shard_name()
    if damage == "flip":
        _corrupt_flip(shard)
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "empty":
        shard.write_bytes(b"")
    elif damage == "missing":
        shard.unlink()
    else:
        (d6 / "meta.json").write_text('{"step": 6, "shards": ')
    capsys.readouterr()
    tr = train(small_overrides, *common, "training.max_steps=8", "training.resume=true")
    out = capsys.readouterr().out
    assert tr.step == 8
    assert "skipping checkpoint" in out and str(d6) in out, out
    import re
    assert re.search(reason, out), out
    assert "resumed from step 4" in out
    assert (run / "checkpoints" / "rejected_step_000006").is_dir()  # kept for inspection, never loaded or pruned
    got, ref = losses(run), losses(ref_dir)
    assert got == ref and sorted(got) == list(range(1, 9)), (got, ref)


def test_no_verifiable_checkpoint_is_an_error_not_a_fresh_start(small_overrides, tmp_path):
    train(small_overrides, "training.max_steps=2")
    shard = ckpt.step_dir(tmp_path / "run" / "checkpoints", 2) / ckpt.shard_name()
    shard.write_bytes(b"")
    with pytest.raises(ValueError, match=r"no checkpoint in .* verifies \(1 rejected"):
        Trainer(load_config(TINY, small_overrides + ["training.max_steps=4", "training.resume=true"]))


@pytest.mark.parametrize("change, words", [
    ("model.hidden_size=128", "model.hidden_size: 64 -> 128"),
    ("model.num_kv_heads=4", "model.num_kv_heads: 2 -> 4"),
    ("model.ffn_hidden_size=256", "model.ffn_hidden_size: 128 -> 256"),
    ("model.vocab_size=384", "vocabulary size (model.vocab_size or the tokenizer's): 320 -> 384"),
    ("training.global_batch_size=8", "training.global_batch_size: 4 -> 8 (the data position"),
    ("training.seq_len=16", "training.seq_len: 32 -> 16"),
    ("data.train_path=bundled:moby_dick", "data.train_path: 'bundled:sotu' -> 'bundled:moby_dick'"),
])
def test_resume_refuses_a_change_the_checkpoint_cannot_take(small_overrides, tmp_path, change, words):
    train(small_overrides, "training.max_steps=2")
    with pytest.raises(ValueError) as e:
        Trainer(load_config(TINY, small_overrides + ["training.max_steps=4", "training.resume=true", change]))
    assert "cannot resume from" in str(e.value) and words in str(e.value), str(e.value)


def test_resume_allows_safe_changes_says_what_they_do_and_keeps_config_toml(small_overrides, tmp_path, capsys):
    train(small_overrides, "training.max_steps=2")
    original = (tmp_path / "run" / "config.toml").read_text()
    capsys.readouterr()
    tr = train(small_overrides, "training.max_steps=4", "training.resume=true", "training.lr=1e-3")
    out = capsys.readouterr().out
    assert "resume: changed training.lr: 0.003 -> 0.001 (the LR schedule changes from the resumed step on)" in out
    assert "resume: changed training.max_steps: 2 -> 4" in out
    assert tr.step == 4
    assert (tmp_path / "run" / "config.toml").read_text() == original
    assert load_config(tmp_path / "run" / "config.resumed_step_000002.toml").training.lr == 1e-3


def test_resume_on_a_fresh_directory_records_the_initial_plan(small_overrides, tmp_path):
    train(small_overrides, "training.max_steps=1", "training.resume=true")
    assert (tmp_path / "run" / "plans" / "step_000000.json").is_file()


def test_metrics_do_not_repeat_steps_after_a_resume(small_overrides, tmp_path):
    common = ["training.log_interval=1", "training.eval_interval=100", "training.save_interval=2"]
    tr = Trainer(load_config(TINY, small_overrides + common + ["training.max_steps=6"]))
    tr.fit()
    tr.logger.close()
    shutil.rmtree(ckpt.step_dir(tmp_path / "run" / "checkpoints", 6))  # "crash" after step 5's records
    train(small_overrides, *common, "training.max_steps=6", "training.resume=true")
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6], steps


def test_checkpoint_shard_checksum_is_recorded_and_verified(tmp_path):
    root = tmp_path / "checkpoints"
    digest = ckpt.write_shard(root, 1, {"x": 1})
    ckpt.commit(root, 1, {"step": 1, "tp": 1, "pp": 1}, keep=2)
    assert ckpt.read_meta(root, 1)["shards"] == {ckpt.shard_name(): digest}
    assert ckpt.verify(root, 1)["step"] == 1
    with pytest.raises(ValueError, match=r"saved with tp=1 pp=1 and has no shard_tp01_pp00.pt; resume with the same"):
        ckpt.verify(root, 1, tp=2)
    assert ckpt.latest_verified(root) == (1, [])  # intact whatever the layout: never set aside for it


def test_pruning_never_deletes_checkpoints_newer_than_the_one_saved(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (29, 30, 2):
        ckpt.write_shard(root, step, {"s": step})
        ckpt.commit(root, step, {"step": step}, keep=1)
    assert ckpt.list_checkpoints(root) == [2, 30]


def test_a_checkpoint_of_another_layout_is_refused_not_set_aside(small_overrides, tmp_path):
    """An intact tp=1 checkpoint passes the integrity check (so resume never sets it aside); only
    the layout check, asked for a tp=2 run, refuses it - naming both layouts."""
    root = tmp_path / "checkpoints"
    ckpt.write_shard(root, 4, {"x": 1})
    ckpt.commit(root, 4, {"step": 4, "tp": 1, "pp": 1}, keep=2)
    assert ckpt.latest_verified(root) == (4, [])
    with pytest.raises(ValueError, match="saved with tp=1 pp=1 and has no shard_tp01_pp00.pt"):
        ckpt.verify(root, 4, tp=2, pp=1)
    assert ckpt.list_checkpoints(root) == [4]


def test_snip_replan_counter_is_restored_on_resume(small_overrides, tmp_path):
    from megatron_snip.snip.controller import SnipController

    snip = ["snip.enabled=true", "snip.warmup=1", "snip.interval=1", "snip.probe_batches=1", "snip.noise_draws=1",
            "snip.policy=uniform:fp8", "snip.fp4_target=0", "training.save_interval=3"]
    cfg = load_config(TINY, small_overrides + snip + ["training.max_steps=3"])
    tr = Trainer(cfg)
    ctl = SnipController(cfg, tr)
    tr.fit([ctl])
    tr.logger.close()
    assert ctl.replans == 2  # steps 1 and 2
    cfg2 = load_config(TINY, small_overrides + snip + ["training.max_steps=5", "training.resume=true"])
    resumed = Trainer(cfg2)
    assert SnipController(cfg2, resumed).replans == 2
    resumed.logger.close()
