"""Blended corpora: Megatron's blending index, its cache, the data bundle, val_loss_<name>, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from partial_run import train_steps_and_save

from megatron_snip.config import load_config
from megatron_snip.data import blend as blend_mod
from megatron_snip.data.blend import BlendedDataset, blending_indices, cached_index, index_description
from megatron_snip.data.corpus import write_jsonl
from megatron_snip.data.pipeline import build_data
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
WEIGHTS = [[0.7, 0.3], [0.01, 0.99], [0.5, 0.3, 0.2], *[list(np.random.default_rng(s).dirichlet(np.ones(k)))
                                                        for s, k in ((0, 2), (1, 3), (2, 5), (3, 8))]]


def test_index_is_megatrons_greedy_rule():
    # By hand from Megatron's helpers.build_blending_indices: sample i goes to argmax_d
    # w_d * max(i, 1) - count_d (ties to the lower d). i=0: 0.7 vs 0.3 -> 0; i=1 (max(1,1)=1):
    # 0.7-1 vs 0.3-0 -> 1; i=2: 1.4-1 vs 0.6-1 -> 0; i=3: 2.1-2 vs 0.9-1 -> 0; i=4: 2.8-3 vs 1.2-1 -> 1 ...
    which, local = blending_indices([0.7, 0.3], 0, 10)
    assert which.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert local.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    assert blending_indices([0.5, 0.5], 0, 4)[0].tolist() == [0, 1, 0, 1]  # ties go to the lower index


@pytest.mark.parametrize("weights", WEIGHTS, ids=lambda w: "-".join(f"{x:.2f}" for x in w))
def test_every_prefix_keeps_each_share_within_a_sample(weights):
    n = 20_000
    which, local = blending_indices(weights, 0, n)
    t = np.arange(1, n + 1)
    for d, w in enumerate(weights):
        count = np.cumsum(which == d)
        # A source is picked only while its lag w*t - count is the largest, hence >= 0 (the lags
        # sum to 0), and the pick lowers it by 1 - w: no source is ever a whole sample ahead.
        assert (count - w * t).max() < 1
        # Two sources: one's lead is the other's lag, so both stay within one sample. With k
        # sources a lag is the sum of the others' leads, each < 1 (measured here: at most 1.18).
        assert (w * t - count).max() < (1 if len(weights) == 2 else len(weights) - 1)
        assert np.array_equal(local[which == d], np.arange(count[-1]))  # each source's samples in order


def test_index_continues_where_it_stopped():
    w = [0.5, 0.3, 0.2]
    which, local = blending_indices(w, 0, 5000)
    counts = np.zeros(3, np.int64)
    a = blending_indices(w, 0, 1234, counts)
    b = blending_indices(w, 1234, 5000, counts)
    assert np.array_equal(np.concatenate([a[0], b[0]]), which) and np.array_equal(np.concatenate([a[1], b[1]]), local)
    ds = BlendedDataset([_FakeSource(7), _FakeSource(11), _FakeSource(13)], w, ["a", "b", "c"], index=(a[0], a[1]))
    got_which, got_local = ds.source_of(np.arange(4990, 5000))  # past the cached prefix: extended in memory
    assert np.array_equal(got_which, which[4990:]) and np.array_equal(got_local, local[4990:])


class _FakeSource:
    """A GPTDataset stand-in whose sample s is the row [tag, s, s, ...]."""

    def __init__(self, tag: int, seq_len: int = 3) -> None:
        self.tag, self.seq_len, self.num_windows = tag, seq_len, 100

    def samples(self, idx):
        import torch

        out = torch.as_tensor(np.asarray(idx), dtype=torch.int64)[:, None].repeat(1, self.seq_len + 1)
        out[:, 0] = self.tag
        return out


def test_batch_rows_come_from_the_indexed_source_sample():
    ds = BlendedDataset([_FakeSource(7), _FakeSource(11)], [0.7, 0.3], ["a", "b"])
    rows = ds.batch(3, 6)
    which, local = blending_indices([0.7, 0.3], 0, 9)
    assert rows[:, 0].tolist() == [(7, 11)[d] for d in which[3:]]
    assert rows[:, 1].tolist() == local[3:].tolist()


def test_cache_is_written_once_keyed_by_its_inputs_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    desc = {"algorithm": blend_mod.ALGORITHM, "size": 500, "weights": [0.6, 0.4], "sources": [{"name": "a"}, {"name": "b"}]}
    which, local, path = cached_index(tmp_path, desc, write=True)
    assert path.is_file() and path.parent == tmp_path
    assert np.array_equal(which, blending_indices([0.6, 0.4], 0, 500)[0])

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(blend_mod, "blending_indices", boom)
    again = cached_index(tmp_path, desc, write=True)
    assert again[2] == path and np.array_equal(again[0], which) and np.array_equal(again[1], local)
    monkeypatch.undo()
    other = cached_index(tmp_path, {**desc, "weights": [0.5, 0.5]}, write=True)
    assert other[2] != path  # other inputs, other file
    path.write_bytes(path.read_bytes()[:100])  # truncated: rebuilt, same index
    rebuilt = cached_index(tmp_path, desc, write=True)
    assert np.array_equal(rebuilt[0], which) and np.array_equal(rebuilt[1], local)
    with np.load(path) as z:  # and rewritten whole
        assert json.loads(str(z["description"])) == desc


def _corpus(path, word, n=12):
    write_jsonl([{"text": f"{word} {i} " * (10 + i)} for i in range(n)], path)
    return str(path)


@pytest.fixture
def small_overrides(small_overrides):
    """One evaluation micro-batch: these corpora's held-out splits hold only a few windows, and
    a longer evaluation is refused (data/pipeline.check_eval_batches)."""
    return small_overrides + ["training.eval_batches=1"]


@pytest.fixture
def two_corpora(tmp_path):
    return _corpus(tmp_path / "alpha.jsonl", "alpha"), _corpus(tmp_path / "beta.jsonl", "beta")


def test_bundle_of_a_blend(small_overrides, two_corpora, tmp_path):
    a, b = two_corpora
    cfg = load_config(TINY, small_overrides + [f"data.train_path={json.dumps(['0.7', a, '0.3', b])}",
                                               "training.max_steps=5"])
    data = build_data(cfg)
    assert isinstance(data.train, BlendedDataset) and data.train.names == ["alpha", "beta"]
    assert set(data.valid) == {"valid", "alpha", "beta"}
    assert list((tmp_path / "cache").glob("blend_*.npz"))  # cached next to the tokenized corpora
    # Every training row is a window of the source the index names: its text is that source's word.
    rows = data.train.batch(0, 20)
    which, _ = blending_indices([0.7, 0.3], 0, 20)
    for row, d in zip(rows, which, strict=True):
        text = bytes(t for t in row.tolist() if t < 256).decode("utf-8", "replace")
        assert ("alpha", "beta")[d] in text and ("alpha", "beta")[1 - d] not in text
    # The table form reads the same; so does a description hash (same cache file).
    table = load_config(TINY, small_overrides + [f'data.train_path={{"{a}" = 0.7, "{b}" = 0.3}}'])
    assert table.data.blend() == cfg.data.blend()


def test_blend_trains_logs_each_source_and_resumes_exactly(small_overrides, two_corpora, tmp_path):
    a, b = two_corpora
    common = [f"data.train_path={json.dumps(['2', a, '1', b])}", "training.log_interval=1", "training.eval_interval=3",
              "training.max_steps=6"]
    full = Trainer(load_config(TINY, small_overrides + common))
    full.fit()
    full.logger.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert len(evals) == 2 and all({"val_loss_alpha", "val_loss_beta"} <= r.keys() for r in evals)
    ref = {r["step"]: r["loss"] for r in rows if "loss" in r}

    over2 = [o for o in small_overrides if not o.startswith("training.run_dir")] + [f"training.run_dir={tmp_path / 'r2'}"]
    first = Trainer(load_config(TINY, over2 + common + ["training.save_interval=3"]))
    train_steps_and_save(first, 3)
    resumed = Trainer(load_config(TINY, over2 + common + ["training.resume=true"]))
    assert resumed.step == 3
    resumed.fit()
    resumed.logger.close()
    got = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "r2" / "metrics.jsonl").read_text().splitlines())
           if "loss" in r}
    assert got == ref


@pytest.mark.parametrize("value, needle", [
    ('["0.7", "a", "0.3"]', "got 3 entries"),
    ('["x", "a", "0.3", "b"]', "entry 0 ('x') should be a weight"),
    ('["0", "a", "1", "b"]', "weights must be finite and > 0"),
    ('["-1", "a", "1", "b"]', "weights must be finite and > 0"),
    ('["nan", "a", "1", "b"]', "weights must be finite and > 0"),
    ('["1", "a", "1", "a"]', "'a' is listed twice"),
])
def test_bad_blend_is_refused_naming_the_field(value, needle):
    with pytest.raises(ValueError, match="data.train_path") as e:
        load_config(None, [f"data.train_path={value}"])
    assert needle in str(e.value)


def test_missing_or_clashing_sources_are_refused(small_overrides, two_corpora, tmp_path):
    a, b = two_corpora
    missing = str(tmp_path / "nope.jsonl")
    cfg = load_config(TINY, small_overrides + [f"data.train_path={json.dumps(['1', a, '1', missing])}"])
    with pytest.raises(ValueError, match=r"config data.train_path .*nope.jsonl.* is neither a file"):
        build_data(cfg)
    (tmp_path / "other").mkdir()
    same_name = _corpus(tmp_path / "other" / "alpha.jsonl", "gamma")
    cfg = load_config(TINY, small_overrides + [f"data.train_path={json.dumps(['1', a, '1', same_name])}"])
    with pytest.raises(ValueError, match="both named 'alpha'"):
        build_data(cfg)
    cfg = load_config(TINY, small_overrides + [f"data.train_path={json.dumps(['1', a, '1', b])}",
                                               f"data.valid_paths={json.dumps([b])}"])
    with pytest.raises(ValueError, match="data.valid_paths"):
        build_data(cfg)


def test_description_names_the_sources(small_overrides, two_corpora):
    a, b = two_corpora
    data = build_data(load_config(TINY, small_overrides + [f"data.train_path={json.dumps(['1', a, '1', b])}"]))
    desc = index_description(data.train.weights, data.train.sources, data.train.names, 40)
    assert [s["name"] for s in desc["sources"]] == ["alpha", "beta"] and desc["size"] == 40
