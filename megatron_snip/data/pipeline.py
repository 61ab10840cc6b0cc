"""From a DataConfig to ready datasets: tokenizer, tokenize-once cache, train/valid split.

A corpus path is one of
  * ``bundled:<name>`` - a sample shipped in the package (``sotu``, ``moby_dick``),
  * a JSONL file (``{"text": ...}`` per line, plain or .gz) - tokenized once into the cache,
  * an indexed prefix ``path/name`` with ``name.bin`` / ``name.idx`` (Megatron's format).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_snip.atomic_io import ensure_writable_dir
from megatron_snip.config import Config, DataConfig
from megatron_snip.data import indexed
from megatron_snip.data.corpus import bundled_sample_path, prepare_tokens, read_jsonl
from megatron_snip.data.dataset import GPTDataset, build_datasets
from megatron_snip.data.indexed import IndexedDataset
from megatron_snip.data.tokenizer import Tokenizer, build_tokenizer


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: GPTDataset
    valid: dict[str, GPTDataset]  # "valid" (held-out split of train_path) + one per data.valid_paths


def resolve_corpus(path: str) -> str:
    """``bundled:<name>`` -> the packaged file; anything else is checked to exist."""
    if path.startswith("bundled:"):
        return bundled_sample_path(path.split(":", 1)[1])
    if indexed.exists(path) or os.path.isfile(path):
        return path
    raise ValueError(f"config data path {path!r} is neither a file nor an indexed prefix (.bin/.idx); "
                     f"use bundled:sotu, a JSONL file, or run scripts/prepare_corpus.py / scripts/preprocess_data.py")


def corpus_name(path: str) -> str:
    return path.split(":", 1)[1] if path.startswith("bundled:") else Path(path).name.split(".")[0]


def _cache_dir(cfg: DataConfig) -> str:
    d = cfg.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megatron_snip")
    return os.fspath(ensure_writable_dir(d, "data.cache_dir"))


def load_tokenizer_for(cfg: DataConfig) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return build_tokenizer("byte")
    train = resolve_corpus(cfg.train_path)
    if indexed.exists(train) and not os.path.isfile(cfg.tokenizer_path):
        raise ValueError(f"config data.tokenizer_path={cfg.tokenizer_path!r} must name the tokenizer.json that "
                         f"{cfg.train_path!r} was tokenized with")
    texts = None if os.path.isfile(cfg.tokenizer_path) else read_jsonl(train, cfg.json_key)
    return build_tokenizer("bpe", cfg.tokenizer_path or None, texts=texts, vocab_size=cfg.bpe_vocab_size,
                           eod_token=cfg.eod_token, bos_token=cfg.bos_token)


def open_indexed(path: str, tokenizer: Tokenizer, cfg: DataConfig, *, check_ids: bool = True) -> IndexedDataset:
    """The token file of corpus ``path`` (tokenized into the cache first if it is JSONL).

    ``check_ids`` scans the whole ``.bin`` once: every id must be a valid id of ``tokenizer``
    (ids of another tokenizer would index past the embedding - a device assert on GPU)."""
    resolved = resolve_corpus(path)
    prefix = resolved if indexed.exists(resolved) else prepare_tokens(resolved, tokenizer, _cache_dir(cfg), cfg.json_key)
    ds = IndexedDataset(prefix)
    if not np.issubdtype(ds.dtype, np.integer):
        raise ValueError(f"corpus {path!r}: {indexed.bin_path(prefix)} holds {ds.dtype} values, not token ids; "
                         f"tokenize it with scripts/preprocess_data.py (uint16/int32 ids)")
    if check_ids:
        lo, hi = ds.token_range()
        if lo < 0 or hi >= tokenizer.vocab_size:
            raise ValueError(f"corpus {path!r}: token ids in [{lo}, {hi}] but the tokenizer (data.tokenizer="
                             f"{cfg.tokenizer!r}) has ids [0, {tokenizer.vocab_size}); the file was tokenized with "
                             f"another tokenizer - set data.tokenizer/data.tokenizer_path to the one it was made with")
    return ds


def build_data(cfg: Config, *, is_writer: bool = True) -> DataBundle:
    """Tokenizer + datasets for ``cfg``. Every rank calls it; the cache makes the work happen once."""
    d = cfg.data
    tokenizer = load_tokenizer_for(d)
    # The writer checks the token ids; the others wait for its verdict (trainer._build_data).
    train_idx = open_indexed(d.train_path, tokenizer, d, check_ids=is_writer)
    extra = {corpus_name(p): open_indexed(p, tokenizer, d, check_ids=is_writer) for p in d.valid_paths}
    sets = build_datasets(train_idx, cfg.training.seq_len, tokenizer.eod_id, split=d.split,
                          seed=cfg.training.seed, extra_valid=extra)
    valid = {k: v for k, v in sets.items() if k not in ("train", "test")}
    return DataBundle(tokenizer, sets["train"], valid)
