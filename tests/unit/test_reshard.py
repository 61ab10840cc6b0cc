"""training/reshard.py and scripts/reshard_checkpoint.py on one process: a TP=1 checkpoint split
into TP=2 x PP=2 shards and joined back is bit-identical (weights, AdamW moments, step counts), a
run resumed from the round-tripped checkpoint logs bit-identical losses to one resumed from the
original, and impossible layouts are refused. (Training at TP=2 x PP=2 and converting: see
tests/distributed/test_hf_parallel.py.)"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from megatron_snip.config import load_config
from megatron_snip.training import reshard
from megatron_snip.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import reshard_checkpoint

TINY = "launch/configs/tiny.toml"


def _losses(overrides, run_dir: Path, steps: int) -> list[float]:
    tr = Trainer(load_config(TINY, [*overrides, f"training.run_dir={run_dir}", f"training.max_steps={steps}",
                                    "training.resume=true"]))
    out = []
    while tr.step < steps:
        out.append(tr.train_step(tr.step).loss)
        tr.step += 1
    tr.logger.close()
    return out


def _assert_same(a: reshard.FullCheckpoint, b: reshard.FullCheckpoint) -> None:
    assert a.model.keys() == b.model.keys() and a.moments.keys() == b.moments.keys() and a.moments
    for n in a.model:
        assert torch.equal(a.model[n], b.model[n]), n
        for m in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.moments[n][m], b.moments[n][m]), (n, m)


def test_reshard_round_trip_is_bit_exact_and_resumes_identically(small_overrides, tmp_path):
    base = small_overrides[:-2] + [f"data.cache_dir={tmp_path / 'cache'}"]
    tr = Trainer(load_config(TINY, [*base, f"training.run_dir={tmp_path / 'a'}", "training.max_steps=3"]))
    tr.fit()
    tr.logger.close()
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "2", "--pp", "2", "--out", str(tmp_path / "b")]) == 0
    step_b = tmp_path / "b" / "checkpoints" / "step_000003"
    assert sorted(p.name for p in step_b.iterdir()) == ["meta.json"] + sorted(f"shard_tp0{t}_pp0{p}.pt" for p in (0, 1)
                                                                                for t in (0, 1))
    assert load_config(tmp_path / "b" / "config.toml").parallel.tp == 2
    # back to TP=1 in place
    assert reshard_checkpoint.main([str(step_b), "--tp", "1", "--pp", "1"]) == 0
    orig = reshard.read_full(*reshard.resolve_checkpoint(tmp_path / "a_copy"))
    back = reshard.read_full(*reshard.resolve_checkpoint(tmp_path / "b"))
    _assert_same(orig, back)
    assert _losses(base, tmp_path / "b", 5) == _losses(base, tmp_path / "a_copy", 5)


def test_impossible_layouts_are_refused(small_overrides, tmp_path, capsys):
    base = small_overrides[:-2] + [f"data.cache_dir={tmp_path / 'cache'}"]
    Trainer(load_config(TINY, [*base, f"training.run_dir={tmp_path / 'a'}", "training.max_steps=1"])).fit()
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "3", "--pp", "1"]) == 2
    assert "cannot reshard to tp=3: model.num_attention_heads=4 is not divisible by it" in capsys.readouterr().err
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "1", "--pp", "3"]) == 2
    assert "cannot reshard to pp=3: model.num_layers=2" in capsys.readouterr().err
    assert reshard_checkpoint.main([str(tmp_path / "nothing"), "--tp", "1", "--pp", "1"]) == 2
    assert "no checkpoint there" in capsys.readouterr().err


def test_resume_at_another_layout_reshards_on_load_like_the_script(small_overrides, tmp_path, monkeypatch):
    """A TP=2 x PP=2 checkpoint (the script's, from a TP=1 run) resumed at TP=1 with no conversion
    logs the losses of the original TP=1 checkpoint and of the script's conversion back, bit for
    bit; on load each stage reads only the source stages holding its parameters, memory-mapped."""
    base = small_overrides[:-2] + [f"data.cache_dir={tmp_path / 'cache'}"]
    tr = Trainer(load_config(TINY, [*base, f"training.run_dir={tmp_path / 'a'}", "training.max_steps=3"]))
    tr.fit()
    tr.logger.close()
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "2", "--pp", "2", "--out", str(tmp_path / "b")]) == 0
    shutil.copytree(tmp_path / "b", tmp_path / "converted")
    assert reshard_checkpoint.main([str(tmp_path / "converted"), "--tp", "1", "--pp", "1"]) == 0
    direct = _losses(base, tmp_path / "b", 5)  # b's config.toml says tp=2 pp=2; this run has tp=1 pp=1
    assert direct == _losses(base, tmp_path / "converted", 5) == _losses(base, tmp_path / "a", 5)

    # One stage of a TP=1 x PP=2 layout: reads the two TP shards of source stage 0 only.
    root, step = reshard.resolve_checkpoint(tmp_path / "b")
    reads = []
    real = reshard.ckpt.read_shard
    monkeypatch.setattr(reshard.ckpt, "read_shard", lambda *a, **k: reads.append((a[2:4], k.get("mmap"))) or real(*a, **k))
    full = reshard.read_full(root, step, with_optimizer=False)
    stage = reshard.stage_model(full.cfg, full.vocab_size, 1, 2, 0, 0)
    reads.clear()
    got = reshard.stage_state(root, step, stage, 2, 0)
    assert reads == [((0, 0), True), ((1, 0), True)]
    want = reshard.shard_state(full, stage, 2, 0)
    assert got["layout"] == want["layout"] == {"tp": 1, "pp": 2, "tp_rank": 0, "pp_rank": 0, "layers": [0]}
    assert got["model"].keys() == want["model"].keys()
    for name in want["model"]:
        assert torch.equal(got["model"][name], want["model"][name]), name


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_reshard_validates_everything_before_writing_anything(small_overrides, tmp_path, capsys):
    """Issue #26: a corrupt source is refused (as resume refuses it), and a refused layout leaves
    the source (--out = the source) and the filesystem (--out = a new directory) untouched."""
    base = small_overrides[:-2] + [f"data.cache_dir={tmp_path / 'cache'}"]
    Trainer(load_config(TINY, [*base, f"training.run_dir={tmp_path / 'a'}", "training.max_steps=1"])).fit()
    before = _files(tmp_path / "a")
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "3", "--pp", "1", "--out", str(tmp_path / "a")]) == 2
    assert "cannot reshard to tp=3" in capsys.readouterr().err
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "2", "--pp", "1", "--out", str(tmp_path / "a")]) == 2
    assert "is the source run directory; omit --out" in capsys.readouterr().err
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "3", "--pp", "1", "--out", str(tmp_path / "new")]) == 2
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "0", "--pp", "1"]) == 2
    assert "--tp=0 must be a positive integer" in capsys.readouterr().err
    assert _files(tmp_path / "a") == before and not (tmp_path / "new").exists()

    shard = tmp_path / "a" / "checkpoints" / "step_000001" / "shard_tp00_pp00.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensors: torch.load would not notice
    shard.write_bytes(bytes(data))
    assert reshard_checkpoint.main([str(tmp_path / "a"), "--tp", "2", "--pp", "1", "--out", str(tmp_path / "b")]) == 2
    assert "shard shard_tp00_pp00.pt is corrupt (sha256" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
