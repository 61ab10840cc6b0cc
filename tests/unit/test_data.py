"""Data pipeline: tokenizers, Megatron indexed files, GPT windows/splits/DP slicing, corpus cache."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import pickle
import struct
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_snip.data import corpus as corpus_mod
from megatron_snip.data.corpus import (
    BUNDLED_SAMPLES,
    bundled_sample_path,
    prepare_tokens,
    read_jsonl,
    tokenize_to_indexed,
    unigram_cross_entropy,
    unigram_entropy,
    write_jsonl,
)
from megatron_snip.data.dataset import (
    GPTBatchLoader,
    GPTDataset,
    build_datasets,
    eval_micro_batches,
    eval_window_batches,
    parse_split,
    split_documents,
    spread_windows,
)
from megatron_snip.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    bin_path,
    idx_path,
    optimal_dtype,
)
from megatron_snip.data.tokenizer import BPETokenizer, ByteTokenizer, build_tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Fellow-Citizens of the Senate and House of Representatives: naïve café — 東京 🚀.",
    "Call me Ishmael. Some years ago—never mind how long precisely—having little money.",
    "In meeting you again I feel much satisfaction in being able to repeat my congratulations.",
] * 5


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"_script_{name}"] = mod  # dataclasses look their module up while executing
    spec.loader.exec_module(mod)
    return mod


def _build(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_document(d)
    return IndexedDataset(prefix)


def _docs(num_docs=12, eod=999, seed=0, lo=1, hi=60):
    """Documents of distinct token values (doc d uses ids d*1000+...), each ending in EOD."""
    rng = np.random.default_rng(seed)
    return [np.append(d * 1000 + 1 + np.arange(rng.integers(lo, hi)), eod) for d in range(num_docs)]


# --- indexed dataset --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_indexed_round_trip(tmp_path, dtype):
    docs = [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.arange(1000) % 300, np.array([65499 if dtype == np.uint16 else 2**31 - 1])]
    ds = _build(tmp_path / "c", docs, dtype)
    assert ds.dtype == np.dtype(dtype) and len(ds) == 4 and ds.num_documents == 4
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.get(2, offset=10, length=5), docs[2][10:15])
    np.testing.assert_array_equal(ds.get(2, offset=995), docs[2][995:])
    np.testing.assert_array_equal(ds.sequence_lengths, [3, 0, 1000, 1])
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 2, 3, 4])
    assert [len(x) for x in ds[1:3]] == [0, 1000]
    starts, ends = ds.document_token_ranges()
    np.testing.assert_array_equal(ends - starts, [3, 0, 1000, 1])
    ds2 = pickle.loads(pickle.dumps(ds))  # re-maps by prefix
    np.testing.assert_array_equal(ds2[2], docs[2])
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)


def test_multi_sequence_documents(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "s", np.int32) as b:
        b.add_document(np.arange(10), lengths=[4, 6])
        b.add_document(np.arange(3))
    ds = IndexedDataset(tmp_path / "s")
    np.testing.assert_array_equal(ds.sequence_lengths, [4, 6, 3])
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])
    np.testing.assert_array_equal(ds[1], np.arange(4, 10))
    starts, ends = ds.document_token_ranges()
    np.testing.assert_array_equal(starts, [0, 10])
    np.testing.assert_array_equal(ends, [10, 13])


def _megatron_idx_bytes(code, seq_lengths, doc_indices, itemsize):
    """Index bytes packed as Megatron's _IndexWriter packs them (independent of our writer)."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(seq_lengths)) + struct.pack("<Q", len(doc_indices))
    ptrs, p = [], 0
    for n in seq_lengths:
        ptrs.append(p)
        p += n * itemsize
    out += struct.pack(f"<{len(seq_lengths)}i", *seq_lengths)
    out += struct.pack(f"<{len(ptrs)}q", *ptrs)
    out += struct.pack(f"<{len(doc_indices)}q", *doc_indices)
    return out


def test_reads_and_writes_megatron_layout_byte_for_byte(tmp_path):
    seqs = [[1, 2, 3], [40000, 5], [7, 8, 9, 10]]  # three docs, uint16 (code 8)
    prefix = str(tmp_path / "meg")
    with open(prefix + ".idx", "wb") as f:
        f.write(_megatron_idx_bytes(8, [3, 2, 4], [0, 1, 2, 3], 2))
    with open(prefix + ".bin", "wb") as f:
        f.write(struct.pack("<9H", *[t for s in seqs for t in s]))
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 3
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    # Our writer produces exactly these bytes.
    ours = _build(tmp_path / "ours", [np.array(s) for s in seqs], np.uint16)
    assert Path(idx_path(ours.prefix)).read_bytes() == Path(prefix + ".idx").read_bytes()
    assert Path(bin_path(ours.prefix)).read_bytes() == Path(prefix + ".bin").read_bytes()
    # int32 (code 4), one document made of two sequences.
    p2 = str(tmp_path / "meg32")
    Path(p2 + ".idx").write_bytes(_megatron_idx_bytes(4, [2, 1], [0, 2], 4))
    Path(p2 + ".bin").write_bytes(struct.pack("<3i", 70000, -1, 3))
    ds32 = IndexedDataset(p2)
    assert ds32.num_documents == 1 and ds32[0].tolist() == [70000, -1] and ds32[1].tolist() == [3]


def test_optimal_dtype_matches_megatron():
    assert optimal_dtype(320) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(128256) == np.int32


def test_builder_is_atomic_and_checks_range(tmp_path):
    prefix = tmp_path / "a"
    with pytest.raises(ValueError, match="do not fit dtype uint16"), IndexedDatasetBuilder(prefix, np.uint16) as b:
        b.add_document([1, 2])
        b.add_document([70000])
    assert os.listdir(tmp_path) == []  # no partial files, no temp files
    with pytest.raises(ValueError, match="dtype"):
        IndexedDatasetBuilder(prefix, np.uint32)
    _build(prefix, [np.array([1, 2])])
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.bin.sha256", "a.idx", "a.idx.fingerprint"]
    assert oct(os.stat(bin_path(prefix)).st_mode & 0o777) == "0o644"


def test_reader_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        IndexedDataset(tmp_path / "missing")
    p = str(tmp_path / "bad")
    Path(p + ".bin").write_bytes(b"")
    Path(p + ".idx").write_bytes(b"NOTANIDX" + b"\x00" * 40)
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(p)
    Path(p + ".idx").write_bytes(_megatron_idx_bytes(8, [3], [0, 1], 2))
    Path(p + ".bin").write_bytes(b"\x00" * 4)  # 2 tokens, index says 3
    with pytest.raises(ValueError, match="index says 3 tokens"):
        IndexedDataset(p)
    Path(p + ".idx").write_bytes(_megatron_idx_bytes(9, [3], [0, 1], 2))
    with pytest.raises(ValueError, match="dtype code 9"):
        IndexedDataset(p)


# --- tokenizers -------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.raw_vocab_size, tok.eod_id) == (320, 257, 256)
    text = "naïve café — 東京 🚀\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod_id, 300]) == text  # EOD / padding decode to nothing
    assert tok.encode_batch([text, ""]) == [ids, []]
    tok.save(tmp_path / "byte.json")
    back = load_tokenizer(tmp_path / "byte.json")
    assert isinstance(back, ByteTokenizer) and back.identity() == tok.identity()
    assert ByteTokenizer(pad_to=128).vocab_size == 384


def test_bpe_train_save_load_round_trip(tmp_path):
    tok = BPETokenizer.train(TEXTS, vocab_size=300, min_frequency=1)
    assert tok.raw_vocab_size <= 300 and tok.vocab_size % 64 == 0
    assert tok.eod_id == 0  # the first special token
    for t in TEXTS[:4] + ["unseen ünïcødé ✓ text"]:
        ids = tok.encode(t)
        assert tok.decode(ids) == t and tok.eod_id not in ids
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges happened
    path = tmp_path / "tok.json"
    tok.save(path)
    back = BPETokenizer.from_file(path)
    assert back.identity() == tok.identity() and back.eod_id == tok.eod_id
    assert back.encode_batch(TEXTS[:4]) == [tok.encode(t) for t in TEXTS[:4]]
    assert isinstance(load_tokenizer(path), BPETokenizer)
    other = BPETokenizer.train(TEXTS[:2], vocab_size=280, min_frequency=1)
    assert other.identity() != tok.identity()


def test_build_tokenizer(tmp_path):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    path = tmp_path / "sub" / "bpe.json"
    with pytest.raises(ValueError, match="no texts to train on"):
        build_tokenizer("bpe", path)
    trained = build_tokenizer("bpe", path, texts=iter(TEXTS), vocab_size=290)
    assert path.is_file()
    loaded = build_tokenizer("bpe", path)  # no texts needed now
    assert loaded.identity() == trained.identity()
    with pytest.raises(ValueError, match="kind='sentencepiece'"):
        build_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="vocab_size=100"):
        BPETokenizer.train(TEXTS, vocab_size=100)


# --- GPT dataset ------------------------------------------------------------------------------

def _stream(docs):
    return np.concatenate(docs)


def test_windows_are_shifted_and_cover_stream(tmp_path):
    docs = _docs()
    ds = _build(tmp_path / "c", docs)
    seq = 16
    gpt = GPTDataset(ds, seq, eod_id=999, shuffle=False)
    stream = _stream(docs)
    assert gpt.num_tokens == len(stream) and len(gpt) == (len(stream) - 1) // seq
    x = gpt.batch(0, len(gpt))
    assert x.shape == (len(gpt), seq + 1) and x.dtype == torch.int64
    inputs, targets = x[:, :-1], x[:, 1:]
    for w in range(len(gpt)):
        np.testing.assert_array_equal(x[w].numpy(), stream[w * seq : w * seq + seq + 1])
    # the target of position t is the input of position t + 1
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    # consecutive windows share exactly one token
    assert torch.equal(x[1:, 0], x[:-1, -1])
    assert torch.equal(gpt[3], x[3])


def test_virtual_eod_for_documents_stored_without_one(tmp_path):
    with_eod = _docs(5)
    ds = _build(tmp_path / "noeod", [d[:-1] for d in with_eod])  # Megatron without --append-eod
    gpt = GPTDataset(ds, 8, eod_id=999, shuffle=False)
    ref = GPTDataset(_build(tmp_path / "eod", with_eod), 8, eod_id=999, shuffle=False)
    assert gpt.num_tokens == ref.num_tokens
    assert torch.equal(gpt.batch(0, len(gpt)), ref.batch(0, len(ref)))


def test_shuffle_is_seeded_and_a_permutation_per_epoch(tmp_path):
    ds = _build(tmp_path / "c", _docs(30))
    a = GPTDataset(ds, 8, 999, seed=1)
    b = GPTDataset(ds, 8, 999, seed=1)
    c = GPTDataset(ds, 8, 999, seed=2)
    n = len(a)
    assert torch.equal(a.batch(5, 20), b.batch(5, 20))
    assert not torch.equal(a.batch(0, n), c.batch(0, n))
    ordered = GPTDataset(ds, 8, 999, shuffle=False).batch(0, n)
    for epoch in range(2):
        got = a.batch(epoch * n, n)
        # each epoch is a permutation of all windows, and epochs differ in order
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, ordered.tolist()))
    assert not torch.equal(a.batch(0, n), a.batch(n, n))
    # a batch that straddles the epoch boundary equals the two halves
    assert torch.equal(a.batch(n - 3, 6), torch.cat([a.batch(n - 3, 3), a.batch(n, 3)]))


def test_split_is_disjoint_by_document(tmp_path):
    docs = _docs(50)
    ds = _build(tmp_path / "c", docs)
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))
    parts = split_documents(50, "90,8,2", seed=3)
    sets = [set(parts[k].tolist()) for k in ("train", "valid", "test")]
    assert sum(map(len, sets)) == 50 and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert (len(sets[1]), len(sets[2])) == (4, 1)
    assert split_documents(50, "90,8,2", seed=3)["valid"].tolist() == parts["valid"].tolist()
    out = build_datasets(ds, 8, 999, split="90,10", seed=3)
    assert set(out) == {"train", "valid"}
    doc_of = lambda x: set((x[(x != 999)] // 1000).tolist())  # token ids encode their document
    train_docs = doc_of(out["train"].batch(0, len(out["train"])).numpy())
    valid_docs = doc_of(out["valid"].batch(0, len(out["valid"])).numpy())
    assert train_docs and valid_docs and not (train_docs & valid_docs)
    assert valid_docs <= set(split_documents(50, "90,10", seed=3)["valid"].tolist())
    extra = build_datasets(ds, 8, 999, split="100", extra_valid={"held_out": _build(tmp_path / "h", _docs(3))})
    assert set(extra) == {"train", "held_out"} and not extra["held_out"].shuffle


@pytest.mark.parametrize("dp_size,micro,num_micro", [(1, 4, 2), (2, 3, 2), (4, 2, 3)])
def test_dp_ranks_take_disjoint_slices_of_the_global_batch(tmp_path, dp_size, micro, num_micro):
    gpt = GPTDataset(_build(tmp_path / "c", _docs(40)), 8, 999, seed=7)
    consumed = 37
    loaders = [GPTBatchLoader(gpt, micro, num_micro, r, dp_size, consumed_samples=consumed) for r in range(dp_size)]
    gbs = loaders[0].global_batch_size
    assert gbs == micro * num_micro * dp_size
    per_rank = [torch.cat(ld.next()) for ld in loaders]
    assert all(p.shape == (micro * num_micro, 9) for p in per_rank)
    # Rebuild the global batch from the sample indices each rank read (Megatron layout).
    global_batch = gpt.batch(consumed, gbs)
    pieces = {}
    for r, p in enumerate(per_rank):
        for k in range(num_micro):
            start = (k * dp_size + r) * micro
            pieces[start] = p[k * micro : (k + 1) * micro]
    assert sorted(pieces) == list(range(0, gbs, micro))  # disjoint and covering
    assert torch.equal(torch.cat([pieces[s] for s in sorted(pieces)]), global_batch)
    assert all(ld.consumed_samples == consumed + gbs for ld in loaders)


def test_resume_continues_exactly(tmp_path):
    gpt = GPTDataset(_build(tmp_path / "c", _docs(20)), 8, 999, seed=11)
    full = GPTBatchLoader(gpt, 3, 2, dp_rank=1, dp_size=2)
    uninterrupted = [full.next() for _ in range(6)]
    first = GPTBatchLoader(gpt, 3, 2, dp_rank=1, dp_size=2)
    for _ in range(4):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    resumed = GPTBatchLoader(GPTDataset(IndexedDataset(tmp_path / "c"), 8, 999, seed=11), 3, 2, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    for want in uninterrupted[4:]:
        got = resumed.next()
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_eval_micro_batches_one_pass(tmp_path):
    gpt = GPTDataset(_build(tmp_path / "c", _docs(10)), 8, 999, shuffle=False)
    r0 = list(eval_micro_batches(gpt, 2, dp_rank=0, dp_size=2))
    r1 = list(eval_micro_batches(gpt, 2, dp_rank=1, dp_size=2))
    assert len(r0) == len(r1) == len(gpt) // 4
    interleaved = torch.cat([t for pair in zip(r0, r1) for t in pair])
    assert torch.equal(interleaved, gpt.batch(0, 4 * len(r0)))


def test_dataset_bad_input(tmp_path):
    ds = _build(tmp_path / "c", _docs(2, hi=5))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        GPTDataset(ds, 4096, 999)
    with pytest.raises(ValueError, match="seq_len=0"):
        GPTDataset(ds, 0, 999)
    with pytest.raises(ValueError, match="split='abc'"):
        parse_split("abc")
    with pytest.raises(ValueError, match="split='0,100'"):
        parse_split("0,100")
    with pytest.raises(ValueError, match="no training documents"):
        split_documents(2, "10,90")
    gpt = GPTDataset(ds, 2, 999)
    with pytest.raises(ValueError, match="dp_rank=2"):
        GPTBatchLoader(gpt, 1, 1, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        GPTBatchLoader(gpt, 0)
    with pytest.raises(ValueError, match="start_sample=-1"):
        gpt.batch(-1, 2)


# --- corpus -----------------------------------------------------------------------------------

def test_read_jsonl_plain_gz_and_errors(tmp_path):
    recs = [{"id": i, "text": t} for i, t in enumerate(TEXTS[:3])]
    for name in ("a.jsonl", "a.jsonl.gz"):
        assert write_jsonl(recs, tmp_path / name) == 3
        assert list(read_jsonl(tmp_path / name)) == TEXTS[:3]
    with gzip.open(tmp_path / "a.jsonl.gz", "rb") as f:  # json.dumps default layout, ASCII-escaped
        assert f.readline() == (json.dumps(recs[0]) + "\n").encode()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: no 'text' field"):
        list(read_jsonl(tmp_path / "bad.jsonl"))
    (tmp_path / "bad2.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad2.jsonl:1: not valid JSON"):
        list(read_jsonl(tmp_path / "bad2.jsonl"))
    with pytest.raises(ValueError, match="does not exist"):
        list(read_jsonl(tmp_path / "nope.jsonl"))


def test_prepare_tokens_caches(tmp_path, monkeypatch):
    src = tmp_path / "c.jsonl"
    write_jsonl([{"text": t} for t in TEXTS], src)
    tok = ByteTokenizer()
    prefix = prepare_tokens(src, tok, tmp_path / "cache")
    ds = IndexedDataset(prefix)
    assert ds.num_documents == len(TEXTS)
    assert ds[1].tolist() == tok.encode(TEXTS[1]) + [tok.eod_id]
    meta = json.loads(Path(prefix + ".json").read_text())
    assert meta["tokens"] == ds.num_tokens and meta["documents"] == len(TEXTS)

    def boom(*a, **k):
        raise AssertionError("re-tokenized although cached")

    monkeypatch.setattr(corpus_mod, "tokenize_to_indexed", boom)
    assert prepare_tokens(src, tok, tmp_path / "cache") == prefix  # cache hit
    monkeypatch.undo()
    bpe = BPETokenizer.train(TEXTS, 280, min_frequency=1)
    p_bpe = prepare_tokens(src, bpe, tmp_path / "cache")  # other tokenizer -> other files
    assert p_bpe != prefix and IndexedDataset(p_bpe)[0].tolist() == bpe.encode(TEXTS[0]) + [bpe.eod_id]
    write_jsonl([{"text": t} for t in TEXTS[:-1]], src)  # edited corpus -> new key
    assert prepare_tokens(src, tok, tmp_path / "cache") not in (prefix, p_bpe)


def test_tokenize_workers_match_single_process(tmp_path):
    tok = ByteTokenizer()
    s1 = tokenize_to_indexed(TEXTS, tok, tmp_path / "w1", batch_docs=3)
    s2 = tokenize_to_indexed(TEXTS, tok, tmp_path / "w2", workers=2, batch_docs=3)
    assert (s1["documents"], s1["tokens"]) == (s2["documents"], s2["tokens"])
    assert Path(tmp_path / "w1.bin").read_bytes() == Path(tmp_path / "w2.bin").read_bytes()
    assert Path(tmp_path / "w1.idx").read_bytes() == Path(tmp_path / "w2.idx").read_bytes()
    assert s1["text_bytes"] == sum(len(t.encode()) for t in TEXTS)


def test_unigram_entropy():
    v = 8
    assert unigram_entropy(np.arange(4).repeat(10), v) == pytest.approx(np.log(4))
    assert unigram_entropy(np.zeros(5, np.int64), v) == pytest.approx(0.0)
    # with a tiny alpha the cross entropy of a text with itself approaches its entropy
    x = np.array([0, 0, 1, 2, 2, 2])
    assert unigram_cross_entropy(x, x, v, alpha=1e-9) == pytest.approx(unigram_entropy(x, v), rel=1e-6)


def test_bundled_sample():
    total = sum(p.stat().st_size for p in Path(bundled_sample_path("sotu")).parent.iterdir())
    assert total <= 2_000_000
    texts = list(read_jsonl(bundled_sample_path("moby_dick")))
    assert len(texts) == 25 and texts[0].startswith("CHAPTER 1. Loomings.")
    assert set(BUNDLED_SAMPLES) == {"sotu", "moby_dick"}
    with pytest.raises(ValueError, match="name='wiki'"):
        bundled_sample_path("wiki")


# --- scripts (offline) ------------------------------------------------------------------------

def _fake_npm_tarball(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_prepare_corpus_from_local_tarball(tmp_path, monkeypatch):
    pc = _load_script("prepare_corpus")
    body = "x" * 250
    src = pc.NpmSource("@fake/datasets-demo", "1.0.0", "0" * 64, "package/data/chapter_*.txt")
    dl = tmp_path / "dl"
    dl.mkdir()
    tgz = dl / src.tarball_name
    assert src.tarball_name == "fake-datasets-demo-1.0.0.tgz"
    _fake_npm_tarball(tgz, {
        "package/data/chapter_10.txt": f"\n{body} ten\n",
        "package/data/chapter_2.txt": f"{body} two",
        "package/data/chapter_1.txt": f"{body} one ü",
        "package/data/chapter_3.txt": "stub",  # shorter than min_chars
        "package/data/other.txt": f"{body} not a chapter",
        "package/README.md": "readme",
    })
    monkeypatch.setitem(pc.CORPORA, "demo", src)
    with pytest.raises(ValueError, match="does not match the published"):
        pc.build_corpus("demo", str(tmp_path / "out"), str(dl))
    monkeypatch.setitem(pc.CORPORA, "demo", pc.NpmSource(src.package, src.version, corpus_mod.file_sha256(tgz), src.member_glob))
    path, n = pc.build_corpus("demo", str(tmp_path / "out"), str(dl))  # no network: tarball present
    lines = Path(path).read_text().splitlines()
    assert n == 3 and [json.loads(x)["id"] for x in lines] == ["chapter_1", "chapter_2", "chapter_10"]
    assert json.loads(lines[2])["text"] == f"{body} ten"  # stripped
    assert lines[0] == json.dumps({"id": "chapter_1", "text": f"{body} one ü"})
    with pytest.raises(ValueError, match="name='nope'"):
        pc.build_corpus("nope", str(tmp_path), str(dl))


def test_preprocess_data_script(tmp_path, capsys):
    pp = _load_script("preprocess_data")
    src = tmp_path / "in.jsonl.gz"
    write_jsonl([{"body": t} for t in TEXTS], src)
    stats = pp.main(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "c"), "--tokenizer", "bpe",
                     "--tokenizer-path", str(tmp_path / "tok.json"), "--vocab-size", "280", "--json-keys", "body"])
    tok = load_tokenizer(tmp_path / "tok.json")
    ds = IndexedDataset(tmp_path / "out" / "c")
    assert ds.num_documents == len(TEXTS) and ds.dtype == np.uint16
    assert tok.decode(ds[1]) == TEXTS[1] and ds[1][-1] == tok.eod_id
    assert stats["bytes_per_token"] > 1.0 and "bytes/token" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pp.main(["--input", str(src), "--output-prefix", str(tmp_path / "x"), "--tokenizer", "bpe"])


def test_spread_windows_are_evenly_spaced_distinct_and_cover_a_small_set():
    ids = spread_windows(1000, 8)
    np.testing.assert_array_equal(ids, [62, 187, 312, 437, 562, 687, 812, 937])  # middles of 8 slices of 125
    np.testing.assert_array_equal(spread_windows(5, 8), np.arange(5))  # fewer windows than asked: all of them
    for n, k in [(1000, 1024), (1025, 1024), (7, 3), (64, 64)]:
        ids = spread_windows(n, k)
        assert len(ids) == min(n, k) and np.all(np.diff(ids) > 0) and ids[0] >= 0 and ids[-1] < n
    with pytest.raises(ValueError, match="count=-1"):
        spread_windows(10, -1)


def test_eval_window_batches_first_is_the_old_evaluation_and_spread_reaches_the_end(tmp_path):
    gpt = GPTDataset(_build(tmp_path / "c", _docs(40)), 8, eod_id=999, shuffle=False)
    first = eval_window_batches(gpt, 2, 4, "first")
    assert [b.tolist() for b in first] == [gpt.batch(0, 4).tolist(), gpt.batch(4, 4).tolist()]
    spread = eval_window_batches(gpt, 2, 4, "spread")
    whole = gpt.batch(0, len(gpt))
    ids = spread_windows(len(gpt), 8)
    assert torch.equal(torch.cat(spread), whole[ids])
    assert ids[-1] >= len(gpt) * 7 // 8  # the last slice of the set is read
    everything = eval_window_batches(gpt, 10_000, 4, "spread")  # asks for more than there is: whole batches of all
    assert sum(len(b) for b in everything) == len(gpt) // 4 * 4
    for windows in ("first", "spread"):
        with pytest.raises(ValueError, match="micro_batch_size=4096"):
            eval_window_batches(gpt, 1, 4096, windows)
    # "first" on a set smaller than asked: its whole batches, each window once (it read past the end
    # before, which wraps around to the set's first windows again)
    firsts = eval_window_batches(gpt, 10_000, 4, "first")
    assert [b.tolist() for b in firsts] == [gpt.batch(s, 4).tolist() for s in range(0, len(gpt) // 4 * 4, 4)]


def test_eval_micro_batches_spread_are_the_training_evaluations_batches_split_over_dp(tmp_path):
    """``megatron_snip.evaluate --windows spread`` reads what a run with ``eval_windows = "spread"``
    evaluated: the same windows in the same batches on one rank; with DP each batch's share per rank."""
    gpt = GPTDataset(_build(tmp_path / "c", _docs(40)), 8, eod_id=999, shuffle=False)
    trained = eval_window_batches(gpt, 3, 4, "spread")
    mine = list(eval_micro_batches(gpt, 4, max_samples=12, windows="spread"))
    assert [b.tolist() for b in mine] == [b.tolist() for b in trained]
    ranks = [list(eval_micro_batches(gpt, 2, r, 2, max_samples=12, windows="spread")) for r in (0, 1)]
    assert [torch.cat([a, b]).tolist() for a, b in zip(*ranks)] == [b.tolist() for b in trained]
    assert [b.tolist() for b in eval_micro_batches(gpt, 4, max_samples=12)] == \
        [gpt.batch(s, 4).tolist() for s in (0, 4, 8)]  # "first" as before
    with pytest.raises(ValueError, match="windows='middle'"):
        next(eval_micro_batches(gpt, 4, windows="middle"))
