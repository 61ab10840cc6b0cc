"""Any HF tokenizer.json: Llama-2-style (SentencePiece BPE, byte fallback) and Llama-3-style
(tiktoken-style byte-level BPE) files built here, their BOS/EOD from the tokenizer's own special
tokens or from the config, preprocessing + a few training steps, and the start-up refusal of data
made with another tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_snip.config import load_config
from megatron_snip.data.corpus import bundled_sample_path, read_jsonl, write_jsonl
from megatron_snip.data.indexed import IndexedDataset
from megatron_snip.data.tokenizer import BPETokenizer
from megatron_snip.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import make_tiny_hf
import preprocess_data

TINY = "launch/configs/tiny.toml"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """kind -> tokenizer.json path (with a tokenizer_config.json next to it), vocabulary 400."""
    out = {}
    for kind, build in (("llama2", make_tiny_hf.llama2_style_tokenizer), ("llama3", make_tiny_hf.llama3_style_tokenizer)):
        d = tmp_path_factory.mktemp(kind)
        make_tiny_hf.save_tokenizer(build(read_jsonl(bundled_sample_path("sotu")), 400), d, kind)
        out[kind] = d / "tokenizer.json"
    return out


def test_llama2_style_byte_fallback_and_special_tokens(tokenizers):
    tok = BPETokenizer.from_file(tokenizers["llama2"])
    assert (tok.bos_token, tok.bos_id, tok.eod_token, tok.eod_id) == ("<s>", 1, "</s>", 2)
    text = "Fellow citizens 🦙 ok"
    ids = tok.encode(text)
    assert ids[0] == 1 and [3 + b for b in "🦙".encode()] == [i for i in ids if 3 <= i < 259][:4]  # <0xF0>.. bytes
    assert tok.decode(ids) == text


def test_llama3_style_special_tokens_after_the_merges(tokenizers):
    tok = BPETokenizer.from_file(tokenizers["llama3"])
    assert (tok.bos_token, tok.eod_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert tok.bos_id == 397 and tok.eod_id == 398 and tok.raw_vocab_size == 400
    assert tok.decode(tok.encode("The Union is strong.\n")) == "The Union is strong.\n"


def test_special_tokens_without_tokenizer_config_and_by_config(tokenizers, tmp_path):
    bare = tmp_path / "tokenizer.json"
    bare.write_text(tokenizers["llama3"].read_text())  # no tokenizer_config.json next to it
    tok = BPETokenizer.from_file(bare)
    assert (tok.bos_token, tok.eod_token) == ("<|begin_of_text|>", "<|end_of_text|>")  # known names
    tok = BPETokenizer.from_file(bare, eod_token="<|eot_id|>", bos_token="none")
    assert tok.eod_id == 399 and tok.bos_id is None and tok.encode("a b")[0] != 397
    with pytest.raises(ValueError, match=r"eod_token='<\|endoftext\|>' is not in the tokenizer's vocabulary; set "
                                         r"data.eod_token .* one of its special tokens: \['<\|begin_of_text\|>'"):
        BPETokenizer.from_file(bare, eod_token="<|endoftext|>")
    assert BPETokenizer.from_file(bare).identity() != BPETokenizer.from_file(bare, bos_token="none").identity()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 12 documents of the bundled sample (enough windows, fast to tokenize)."""
    path = tmp_path_factory.mktemp("corpus") / "sotu12.jsonl"
    write_jsonl(({"text": t} for _, t in zip(range(12), read_jsonl(bundled_sample_path("sotu")))), path)
    return path


def test_gpt2_style_declared_bos_equal_to_eos_adds_no_bos(tmp_path):
    """GPT-2's tokenizer_config.json names <|endoftext|> as both bos and eos: documents get the EOD only."""
    tok = BPETokenizer.train(["one two three four", "five six seven"] * 20, vocab_size=300)
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<|endoftext|>"},
                                                                "eos_token": "<|endoftext|>"}))
    loaded = BPETokenizer.from_file(tmp_path / "tokenizer.json")
    assert (loaded.eod_token, loaded.bos_id) == ("<|endoftext|>", None)
    assert loaded.identity() == tok.identity()  # same mapping and specials as the trained one: same data cache


def _preprocess(corpus: Path, tok_path: Path, prefix: Path) -> dict:
    return preprocess_data.main(["--input", str(corpus), "--output-prefix", str(prefix),
                                 "--tokenizer", "bpe", "--tokenizer-path", str(tok_path)])


@pytest.mark.parametrize("kind", ["llama2", "llama3"])
def test_preprocess_and_train_with_hf_tokenizer(tokenizers, corpus, small_overrides, tmp_path, kind):
    stats = _preprocess(corpus, tokenizers[kind], tmp_path / "data" / "sotu")
    tok = BPETokenizer.from_file(tokenizers[kind])
    assert stats["bos_id"] == tok.bos_id and stats["eod_id"] == tok.eod_id
    cfg = load_config(TINY, [*small_overrides, "data.tokenizer=bpe", f"data.tokenizer_path={tokenizers[kind]}",
                             f"data.train_path={tmp_path / 'data' / 'sotu'}", "training.max_steps=3"])
    tr = Trainer(cfg)
    assert tr.vocab_size == 448  # 400 padded to a multiple of 64
    doc = IndexedDataset(tmp_path / "data" / "sotu")[0]
    assert doc[0] == tok.bos_id and doc[-1] == tok.eod_id  # documents are <bos> ... <eod>
    final = tr.fit()
    assert final["val_loss"] < 6.1  # ln(448) = 6.10: it learned something in 3 steps


def test_data_from_another_tokenizer_is_refused_at_start_up(tokenizers, corpus, small_overrides, tmp_path):
    prefix = tmp_path / "data" / "sotu"
    _preprocess(corpus, tokenizers["llama2"], prefix)
    base = [*small_overrides, "data.tokenizer=bpe", f"data.train_path={prefix}"]
    with pytest.raises(ValueError, match=r"corpus '.*sotu' was tokenized with another tokenizer than this run's .*"
                                         r"re-run scripts/preprocess_data.py"):
        Trainer(load_config(TINY, [*base, f"data.tokenizer_path={tokenizers['llama3']}"]))
    with pytest.raises(ValueError, match=r"corpus '.*sotu' was tokenized with another tokenizer"):  # same file, other BOS
        Trainer(load_config(TINY, [*base, f"data.tokenizer_path={tokenizers['llama2']}", "data.bos_token=none"]))
    # Without preprocess_data's record (data from elsewhere): the largest id decides.
    Path(str(prefix) + ".json").unlink()
    with pytest.raises(ValueError, match=r"corpus '.*sotu': token ids in \[\d+, 399\] but the tokenizer "
                                         r"\(data.tokenizer='byte'\) has ids \[0, 257\)"):
        Trainer(load_config(TINY, [*small_overrides, f"data.train_path={prefix}"]))  # byte tokenizer
    with pytest.raises(ValueError, match=r"model.vocab_size=64 is smaller than the tokenizer's 400 ids"):
        Trainer(load_config(TINY, [*base, f"data.tokenizer_path={tokenizers['llama2']}", "model.vocab_size=64"]))


def test_preprocess_records_tokenizer_identity(tokenizers, corpus, tmp_path):
    _preprocess(corpus, tokenizers["llama3"], tmp_path / "x")
    meta = json.loads((tmp_path / "x.json").read_text())
    assert meta["tokenizer_identity"] == BPETokenizer.from_file(tokenizers["llama3"]).identity()
    assert meta["raw_vocab_size"] == 400
