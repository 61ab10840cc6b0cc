"""Start-up checks that tokenizer, data and model vocabulary agree (before any token is embedded).

Without them, data tokenized with another tokenizer trains on garbage or fails deep in the
embedding (an IndexError on CPU, a device assert on GPU).
"""

from __future__ import annotations

import json
import os

from megatron_snip.config import Config
from megatron_snip.data import indexed
from megatron_snip.data.pipeline import resolve_corpus
from megatron_snip.data.tokenizer import Tokenizer
from megatron_snip.model.llama import pad_vocab


def model_vocab_size(cfg: Config, tokenizer: Tokenizer, tp: int) -> int:
    """The model's vocabulary V: ``model.vocab_size``, or the tokenizer's padded one when 0.

    V must cover every id the tokenizer can produce (``raw_vocab_size``; an HF model's V may be
    below the tokenizer's padded size) and split evenly over TP."""
    vocab = cfg.model.vocab_size or pad_vocab(tokenizer.vocab_size)
    if vocab < tokenizer.raw_vocab_size:
        raise ValueError(f"config model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer.raw_vocab_size} ids ({tokenizer!r}); set it to 0 to take the tokenizer's, or use "
                         f"the tokenizer the model was trained with (data.tokenizer_path)")
    if vocab % tp:
        raise ValueError(f"config model.vocab_size={vocab} must be divisible by parallel.tp={tp} "
                         f"(vocab-parallel embedding); set it to a multiple of {64 * tp}")
    return vocab


def check_data_tokenizer(cfg: Config, tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse indexed data (``data.train_path``, ``data.valid_paths``) made with another tokenizer.

    JSONL and bundled corpora are tokenized here with this tokenizer (its identity is in the cache
    key), so only indexed prefixes are checked: against the ``PREFIX.json`` that
    scripts/preprocess_data.py writes, or, without one (data from elsewhere), by their largest id."""
    for field, path in [("data.train_path", cfg.data.train_path),
                        *(("data.valid_paths", p) for p in cfg.data.valid_paths)]:
        resolved = resolve_corpus(path)
        if not indexed.exists(resolved):
            continue
        meta_path = resolved + ".json"
        meta = {}
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
        recorded = meta.get("tokenizer_identity")
        if recorded is not None and recorded != tokenizer.identity():
            raise ValueError(f"config {field}={path!r} was tokenized with another tokenizer than this run's "
                             f"({meta_path}: tokenizer={meta.get('tokenizer')!r} vocab_size={meta.get('vocab_size')} "
                             f"eod_id={meta.get('eod_id')} bos_id={meta.get('bos_id')}; this run: {tokenizer!r}); set "
                             f"data.tokenizer / data.tokenizer_path / data.eod_token / data.bos_token to the ones it "
                             f"was made with, or re-run scripts/preprocess_data.py with this tokenizer")
        if recorded is None:
            tokens = indexed.IndexedDataset(resolved).tokens
            top = int(tokens.max()) if len(tokens) else -1
            if top >= min(tokenizer.raw_vocab_size, vocab_size):
                raise ValueError(f"config {field}={path!r} holds token id {top}, but this run's tokenizer has "
                                 f"{tokenizer.raw_vocab_size} ids and the model {vocab_size} rows; the data was made "
                                 f"with another tokenizer: set data.tokenizer_path to it, or re-run "
                                 f"scripts/preprocess_data.py with this one")
