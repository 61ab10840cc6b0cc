"""Issue #36 item 2: the inputs the round-4 rerun found not clean, each now one line naming the
file or field, the value and the fix (exit 2), with nothing half-written - or, where the input
is a form users paste (Megatron's blend string, a prefix's .bin), accepted and said so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL

from megatron_snip import evaluate
from megatron_snip import train as train_cli
from megatron_snip.config import DataConfig, load_config
from megatron_snip.data import indexed
from megatron_snip.data.pipeline import build_data, open_indexed
from megatron_snip.data.tokenizer import build_tokenizer

TINY = "launch/configs/tiny.toml"


def _argv(overrides: list[str]) -> list[str]:
    return ["--config", TINY, *[a for o in overrides for a in ("--set", o)]]


def _one_line_error(capsys, overrides: list[str]) -> str:
    """Run the trainer CLI; it must exit 2 with exactly one ``error:`` line on stderr."""
    assert train_cli.main(_argv(overrides)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.removeprefix("error: ").strip()


def _byte_prefix(path: Path, docs: list[bytes]) -> str:
    """An indexed prefix of byte-tokenized ``docs`` (what scripts/preprocess_data.py writes)."""
    with indexed.IndexedDatasetBuilder(path, np.uint16) as b:
        for d in docs:
            b.add_document(np.frombuffer(d, dtype=np.uint8).astype(np.uint16))
    return str(path)


# --- <run_dir>/tensorboard -------------------------------------------------------------------
def test_tensorboard_path_that_is_a_file_is_refused_at_start_up(small_overrides, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("not a folder")
    msg = _one_line_error(capsys, small_overrides + ["logging.tensorboard=true", "training.max_steps=1"])
    assert msg == (f"config logging.tensorboard=true: '{run / 'tensorboard'}' is a file, not a directory; move what "
                   f"is at {run / 'tensorboard'} away (the event files go there), or set logging.tensorboard=false")
    assert not (run / "config.toml").exists()  # refused before anything of the run is written


def test_unwritable_tensorboard_folder_is_refused_at_start_up(small_overrides, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").symlink_to("/proc")  # unwritable even for root (the tests may run as root)
    msg = _one_line_error(capsys, small_overrides + ["logging.tensorboard=true", "training.max_steps=1"])
    assert msg.startswith(f"config logging.tensorboard=true: '{run / 'tensorboard'}' is not a writable directory ("), msg
    assert msg.endswith("or set logging.tensorboard=false"), msg
    assert not (run / "config.toml").exists()


# --- data.train_path -------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["[]", "{}"])
def test_an_empty_blend_names_data_train_path(small_overrides, capsys, value):
    msg = _one_line_error(capsys, small_overrides + [f"data.train_path={value}"])
    assert msg.startswith("config data.train_path=[]: give a corpus (e.g. \"bundled:sotu\""), msg
    assert 'or a blend of weight, path pairs, e.g. ["0.7", "corpus/a", "0.3", "corpus/b"]' in msg


def test_megatrons_string_blend_form_is_the_list_form():
    assert DataConfig(train_path="0.7 corpus/a 0.3 corpus/b").blend() == \
        DataConfig(train_path=("0.7", "corpus/a", "0.3", "corpus/b")).blend() == ((0.7, "corpus/a"), (0.3, "corpus/b"))
    assert DataConfig(train_path="my corpus.jsonl").blend() == ((1.0, "my corpus.jsonl"),)  # a path with a space
    with pytest.raises(ValueError, match=r"config data.train_path=\['0.7', 'a', '0.3'\]: a blend lists weight, path "
                                         r"pairs .*; got 3 entries"):
        DataConfig(train_path="0.7 a 0.3")


def test_megatrons_string_blend_form_trains_on_both_sources(tmp_path):
    cfg = load_config(TINY, SMALL + [f"data.cache_dir={tmp_path}", "data.train_path=0.7 bundled:sotu 0.3 bundled:moby_dick"])
    data = build_data(cfg)
    assert set(data.valid) == {"valid", "sotu", "moby_dick"}, data.valid.keys()


def test_the_bracketless_blend_gets_the_hint_that_a_blend_is_a_list(small_overrides, capsys):
    msg = _one_line_error(capsys, small_overrides + ["data.train_path=0.7,corpus/a,0.3,corpus/b"])
    assert msg.startswith("config data.train_path '0.7,corpus/a,0.3,corpus/b' is neither a file nor an indexed prefix")
    assert ("if this is a blend, a blend is a list: --set 'data.train_path=[\"0.7\", \"corpus/a\", \"0.3\", "
            "\"corpus/b\"]' (TOML) or Megatron's string form --set 'data.train_path=0.7 corpus/a 0.3 corpus/b'") in msg


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_prefixs_bin_or_idx_file_reads_the_prefix_and_says_so(tmp_path, suffix):
    prefix = _byte_prefix(tmp_path / "corpus", [b"some text of a document " * 40] * 30)
    cfg = load_config(TINY, SMALL + [f"data.cache_dir={tmp_path / 'cache'}", f"data.train_path={prefix}{suffix}"])
    data = build_data(cfg)
    assert data.train.indexed.prefix == prefix  # the indexed pair, not the .bin parsed as JSONL
    assert (f"data: config data.train_path '{prefix}{suffix}' names a file of the indexed prefix '{prefix}'; "
            f"reading {prefix}.bin + {prefix}.idx") in data.notes, data.notes
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.bin"))  # nothing tokenized


# --- training.init_from_ignore_unused --------------------------------------------------------
def test_init_from_ignore_unused_without_init_from_is_refused(small_overrides, capsys):
    msg = _one_line_error(capsys, small_overrides + ["training.init_from_ignore_unused=true"])
    assert msg == ("config training.init_from_ignore_unused=True: needs training.init_from (a Hugging Face "
                   "directory); drop it or set training.init_from")


# --- what the .bin check does not see, said; and the full-hash mode ---------------------------
def _big_prefix(tmp_path: Path) -> str:
    """A .bin of 2.5 MiB (more than the fingerprint's first + last MiB), byte tokens."""
    rng = np.random.default_rng(0)
    return _byte_prefix(tmp_path / "big", [bytes(rng.integers(32, 127, 4096, dtype=np.uint8)) for _ in range(320)])


def _change_the_middle(prefix: str) -> None:
    b = indexed.bin_path(prefix)
    with open(b, "r+b") as f:  # one token in the middle MiB: size, head and tail stay the same
        f.seek(os.path.getsize(b) // 2)
        f.write(b"\x41\x00")


def test_opening_a_prefix_says_once_what_is_not_checked(tmp_path):
    tok, prefix = build_tokenizer("byte"), _big_prefix(tmp_path)
    notes: list[str] = []
    open_indexed(prefix, tok, DataConfig(), notes=notes)
    assert notes == [(f"data: {prefix}.bin is checked against {prefix}.idx.fingerprint (its size and first/last 1 MiB): "
                      f"a change only between those is not detected; data.verify_full_hash=true checks every byte "
                      f"against {prefix}.bin.sha256")], notes
    os.remove(indexed.fingerprint_path(prefix))
    notes.clear()
    open_indexed(prefix, tok, DataConfig(), notes=notes)
    assert len(notes) == 1 and notes[0].startswith(f"data: {prefix}.idx has no fingerprint sidecar") and \
        "another .bin of the same size would be read as this one" in notes[0], notes


def test_the_note_reaches_the_run_log_once(tmp_path, capsys):
    prefix = _big_prefix(tmp_path)
    assert train_cli.main(_argv(SMALL + [f"training.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'c'}",
                                         f"data.train_path={prefix}", "training.max_steps=1"])) == 0
    assert capsys.readouterr().out.count(f"data: {prefix}.bin is checked against") == 1


def test_full_hash_mode_refuses_a_bin_changed_only_in_its_middle(tmp_path):
    tok, prefix = build_tokenizer("byte"), _big_prefix(tmp_path)
    full = DataConfig(verify_full_hash=True)
    notes: list[str] = []
    open_indexed(prefix, tok, full, notes=notes)  # intact: passes, and nothing is left unchecked to say
    assert notes == []
    _change_the_middle(prefix)
    indexed.IndexedDataset(prefix)  # the fingerprint cannot see it (by design) ...
    with pytest.raises(ValueError, match=rf"config data.verify_full_hash=true: config data path '{prefix}': "
                                         rf"{prefix}.bin has sha256 [0-9a-f]{{16}}\.\.\., not the [0-9a-f]{{16}}\.\.\. "
                                         rf"recorded in {prefix}.bin.sha256: the file changed after it was recorded"):
        open_indexed(prefix, tok, full)  # ... the full hash does
    os.remove(indexed.sha256_path(prefix))
    with pytest.raises(ValueError, match=rf"{prefix}.bin.sha256 is missing, so {prefix}.bin cannot be checked; record "
                                         rf"it with `sha256sum {prefix}.bin > {prefix}.bin.sha256`"):
        open_indexed(prefix, tok, full)


def test_the_sha256_sidecar_is_sha256sum_format(tmp_path):
    import hashlib

    prefix = _byte_prefix(tmp_path / "a", [b"abc", b"defg"])
    digest = hashlib.sha256(Path(prefix + ".bin").read_bytes()).hexdigest()
    assert Path(indexed.sha256_path(prefix)).read_text() == f"{digest}  a.bin\n"  # `sha256sum -c` reads it


# --- evaluate --out, and too little text ----------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("round4")
    over = SMALL + [f"training.run_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}", "training.max_steps=2",
                    "training.eval_interval=100"]
    assert train_cli.main(_argv(over)) == 0
    return tmp / "run"


@pytest.mark.parametrize("where", ["directory", "proc"])
def test_evaluate_out_that_cannot_be_written_is_refused_before_evaluating(trained, tmp_path, capsys, monkeypatch, where):
    out = tmp_path if where == "directory" else Path("/proc/megatron_snip_test/eval.json")
    monkeypatch.setattr(evaluate, "evaluate_domains", lambda *a: pytest.fail("evaluated before checking --out"))
    before = set(os.listdir(tmp_path))
    assert evaluate.main(["--checkpoint", str(trained), "--out", str(out), "--max-sequences", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --out '{out}'"), err
    assert ("is a directory, not a file" if where == "directory" else "is not writable") in err, err
    assert set(os.listdir(tmp_path)) == before  # no stray temp file


def test_evaluate_corpus_with_too_little_text_names_the_flag_and_the_file(trained, tmp_path, capsys):
    small = tmp_path / "short.jsonl"
    small.write_text(json.dumps({"text": "hi"}) + "\n")
    assert evaluate.main(["--checkpoint", str(trained), "--no-held-out", "--valid-corpus", f"short={small}"]) == 2
    lines = capsys.readouterr().err.splitlines()  # "using checkpoint ...", then the one error line
    err = lines[-1]
    assert lines[0].startswith("using checkpoint") and len(lines) == 2, lines
    assert err.startswith(f"error: --valid-corpus short={small} ("), err
    assert ".bin): the selected 1 documents hold" in err and "training.seq_len" in err, err


def test_a_blend_source_with_too_little_text_names_the_field_the_source_and_the_file(small_overrides, tmp_path,
                                                                                    capsys):
    small = tmp_path / "short.jsonl"
    small.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    msg = _one_line_error(capsys, small_overrides + [f'data.train_path=["0.5", "bundled:sotu", "0.5", "{small}"]'])
    assert msg.startswith(f"config data.train_path source '{small}' ("), msg
    assert ".bin): the selected" in msg and "fewer than seq_len + 1 = 33 (training.seq_len)" in msg, msg


def test_resuming_with_the_blend_in_the_other_spelling_is_not_a_change():
    from megatron_snip.training.resume_check import compare

    listed = {"data": {"train_path": ["0.7", "corpus/a", "0.3", "corpus/b"]}}
    assert compare(listed, {"data": {"train_path": "0.7 corpus/a 0.3 corpus/b"}}) == ([], [])
    refusals, _ = compare(listed, {"data": {"train_path": "0.6 corpus/a 0.4 corpus/b"}})
    assert len(refusals) == 1 and refusals[0].startswith("data.train_path:"), refusals
