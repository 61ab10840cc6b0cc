"""From a DataConfig to ready datasets: tokenizer, tokenize-once cache, train/valid split.

A corpus path is one of
  * ``bundled:<name>`` - a sample shipped in the package (``sotu``, ``moby_dick``),
  * a JSONL file (``{"text": ...}`` per line, plain or .gz) - tokenized once into the cache,
  * an indexed prefix ``path/name`` with ``name.bin`` / ``name.idx`` (Megatron's format); naming
    ``name.bin`` or ``name.idx`` itself reads that prefix (a note says so), never the file as JSONL.

Opening an indexed corpus the user gave leaves one note for the run's log: what is not checked
about its ``.bin`` (``indexed.weak_check_note``), or nothing with ``data.verify_full_hash``, which
checks every byte instead (``indexed.check_full_hash``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_snip.atomic_io import ensure_writable_dir
from megatron_snip.config import Config, DataConfig
from megatron_snip.data import indexed
from megatron_snip.data.blend import BlendedDataset, cached_index, index_description
from megatron_snip.data.corpus import bundled_sample_path, prepare_tokens, read_jsonl
from megatron_snip.data.dataset import GPTDataset, build_datasets
from megatron_snip.data.indexed import IndexedDataset
from megatron_snip.data.tokenizer import Tokenizer, build_tokenizer


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: GPTDataset | BlendedDataset
    # "valid" (held-out split of train_path; of a blend: the blend of its sources' held-out splits),
    # one per blend source (its held-out split, logged as val_loss_<name>) and one per data.valid_paths
    valid: dict[str, GPTDataset | BlendedDataset]
    notes: list[str] = dataclasses.field(default_factory=list)  # lines for the run's log (what was read how, what is not checked)


def resolve_corpus(path: str, field: str = "data path") -> str:
    """``bundled:<name>`` -> the packaged file; anything else is checked to exist (``field`` names
    the config field in the error)."""
    if path.startswith("bundled:"):
        try:
            return bundled_sample_path(path.split(":", 1)[1])
        except ValueError as e:
            raise ValueError(f"config {field}: {e}") from None
    if indexed.exists(path):
        return path
    if path.endswith((".bin", ".idx")) and indexed.exists(path[:-4]):  # the prefix's own file, named by hand
        return path[:-4]
    if os.path.isfile(path):
        return path
    raise ValueError(f"config {field} {path!r} is neither a file nor an indexed prefix (.bin/.idx); "
                     f"use bundled:sotu, a JSONL file, or run scripts/prepare_corpus.py / scripts/preprocess_data.py"
                     f"{_blend_hint(path)}")


def _blend_hint(path: str) -> str:
    """For ``--set data.train_path=0.7,a,0.3,b`` (not TOML, so read as one path): how to write a blend."""
    parts = [p.strip() for p in path.split(",")]
    try:
        float(parts[0])
    except ValueError:
        return ""
    if len(parts) < 2:
        return ""
    listed = ", ".join(f'\"{p}\"' for p in parts)
    return (f"; if this is a blend, a blend is a list: --set 'data.train_path=[{listed}]' (TOML) or Megatron's "
            f"string form --set 'data.train_path={' '.join(parts)}'")


def corpus_name(path: str) -> str:
    return path.split(":", 1)[1] if path.startswith("bundled:") else Path(path).name.split(".")[0]


def _cache_dir(cfg: DataConfig) -> str:
    d = cfg.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megatron_snip")
    return os.fspath(ensure_writable_dir(d, "data.cache_dir"))


def load_tokenizer_for(cfg: DataConfig) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return build_tokenizer("byte")
    sources = [resolve_corpus(p, "data.train_path") for _, p in cfg.blend()]
    if any(indexed.exists(s) for s in sources) and not os.path.isfile(cfg.tokenizer_path):
        raise ValueError(f"config data.tokenizer_path={cfg.tokenizer_path!r} must name the tokenizer.json that "
                         f"{cfg.train_path!r} was tokenized with")
    texts = None if os.path.isfile(cfg.tokenizer_path) else itertools.chain.from_iterable(
        read_jsonl(s, cfg.json_key) for s in sources)
    return build_tokenizer("bpe", cfg.tokenizer_path or None, texts=texts, vocab_size=cfg.bpe_vocab_size,
                           eod_token=cfg.eod_token, bos_token=cfg.bos_token)


def open_indexed(path: str, tokenizer: Tokenizer, cfg: DataConfig, *, check_ids: bool = True,
                 field: str = "data path", notes: list[str] | None = None) -> IndexedDataset:
    """The token file of corpus ``path`` (tokenized into the cache first if it is JSONL).

    The one check that data and tokenizer agree, before any token is embedded (ids of another
    tokenizer would index past the embedding - a device assert on GPU): an indexed prefix whose
    ``PREFIX.json`` (scripts/preprocess_data.py) records another tokenizer identity is refused;
    ``check_ids`` scans the whole ``.bin`` once: every id must be one ``tokenizer`` can produce.
    JSONL corpora are tokenized here with ``tokenizer`` (its identity is in the cache key).
    ``cfg.verify_full_hash`` (with ``check_ids``: the rank that checks) hashes the whole ``.bin``
    against its recorded sha256; ``notes`` gets the lines for the log (see the module docstring)."""
    resolved = resolve_corpus(path, field)
    prefix = resolved if indexed.exists(resolved) else prepare_tokens(resolved, tokenizer, _cache_dir(cfg), cfg.json_key)
    notes = notes if notes is not None else []
    if prefix == resolved and resolved != path and not path.startswith("bundled:"):
        notes.append(f"data: config {field} {path!r} names a file of the indexed prefix {prefix!r}; reading "
                     f"{indexed.bin_path(prefix)} + {indexed.idx_path(prefix)}")
    if check_ids and cfg.verify_full_hash:
        indexed.check_full_hash(prefix, f"config {field} {path!r}")
    elif prefix == resolved and not path.startswith("bundled:"):  # the user's file (the cache is ours, keyed by sha256)
        notes.append(indexed.weak_check_note(prefix))
    if prefix == resolved and os.path.isfile(prefix + ".json"):
        _check_recorded_tokenizer(path, prefix + ".json", tokenizer)
    ds = IndexedDataset(prefix)
    if not np.issubdtype(ds.dtype, np.integer):
        raise ValueError(f"corpus {path!r}: {indexed.bin_path(prefix)} holds {ds.dtype} values, not token ids; "
                         f"tokenize it with scripts/preprocess_data.py (uint16/int32 ids)")
    if check_ids:
        lo, hi = ds.token_range()
        if lo < 0 or hi >= tokenizer.raw_vocab_size:
            raise ValueError(f"corpus {path!r}: token ids in [{lo}, {hi}] but the tokenizer (data.tokenizer="
                             f"{cfg.tokenizer!r}) has ids [0, {tokenizer.raw_vocab_size}); the file was tokenized "
                             f"with another tokenizer - set data.tokenizer/data.tokenizer_path to the one it was "
                             f"made with, or re-run scripts/preprocess_data.py with this one")
    return ds


def _check_recorded_tokenizer(path: str, meta_path: str, tokenizer: Tokenizer) -> None:
    """Refuse an indexed corpus whose recorded tokenizer identity is not ``tokenizer``'s."""
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"corpus {path!r}: {meta_path} is not readable JSON ({e}); restore it or delete it "
                         f"(the token ids are then checked against the tokenizer instead)") from None
    recorded = meta.get("tokenizer_identity") if isinstance(meta, dict) else None
    if recorded is not None and recorded != tokenizer.identity():
        raise ValueError(f"corpus {path!r} was tokenized with another tokenizer than this run's ({meta_path}: "
                         f"tokenizer={meta.get('tokenizer')!r} vocab_size={meta.get('vocab_size')} "
                         f"eod_id={meta.get('eod_id')} bos_id={meta.get('bos_id')}; this run: {tokenizer!r}); set "
                         f"data.tokenizer / data.tokenizer_path / data.eod_token / data.bos_token to the ones it "
                         f"was made with, or re-run scripts/preprocess_data.py with this tokenizer")


def build_data(cfg: Config, *, is_writer: bool = True) -> DataBundle:
    """Tokenizer + datasets for ``cfg``. Every rank calls it; the cache makes the work happen once."""
    d, t = cfg.data, cfg.training
    tokenizer = load_tokenizer_for(d)
    # The writer checks the token ids; the others wait for its verdict (trainer._build_data).
    blend = d.blend()
    shuffle_seed = None if d.shuffle_seed == -1 else d.shuffle_seed
    notes: list[str] = []
    sources = [open_indexed(p, tokenizer, d, check_ids=is_writer, field="data.train_path", notes=notes)
               for _, p in blend]
    extra = {corpus_name(p): open_indexed(p, tokenizer, d, check_ids=is_writer, field="data.valid_paths", notes=notes)
             for p in d.valid_paths}
    if len(blend) == 1:
        sets = build_datasets(sources[0], t.seq_len, tokenizer.eod_id, split=d.split, seed=t.seed, extra_valid=extra,
                              label=f"config data.train_path={blend[0][1]!r}", shuffle_seed=shuffle_seed)
        valid = {k: v for k, v in sets.items() if k not in ("train", "test")}
        check_eval_batches(cfg, valid)
        return DataBundle(tokenizer, sets["train"], valid, notes)
    names = _blend_names(blend, extra)
    trains, valids = [], {}
    for (_, path), name, source in zip(blend, names, sources, strict=True):
        sets = build_datasets(source, t.seq_len, tokenizer.eod_id, split=d.split, seed=t.seed,
                              label=f"config data.train_path source {path!r}", shuffle_seed=shuffle_seed)
        if "valid" not in sets:
            raise ValueError(f"config data.train_path: source {path!r} has too few documents for a held-out split "
                             f"(data.split={d.split!r}); give it more documents or drop it from the blend")
        trains.append(sets["train"])
        valids[name] = sets["valid"]
    weights = [w for w, _ in blend]
    description = index_description(weights, trains, names, t.max_steps * t.global_batch_size)
    which, local, _ = cached_index(_cache_dir(d), description, write=is_writer)
    train = BlendedDataset(trains, weights, names, index=(which, local))
    valid = {"valid": BlendedDataset(list(valids.values()), weights, names), **valids, **extra}
    check_eval_batches(cfg, valid)
    return DataBundle(tokenizer, train, valid, notes)


def _blend_names(blend: tuple[tuple[float, str], ...], extra: dict) -> list[str]:
    """One ``val_loss_<name>`` name per blend source: distinct, and none a data.valid_paths name."""
    names = [corpus_name(p) for _, p in blend]
    for i, n in enumerate(names):
        other = names.index(n)
        if other != i:
            raise ValueError(f"config data.train_path: sources {blend[other][1]!r} and {blend[i][1]!r} are both named "
                             f"{n!r} (their val_loss_{n} would clash); rename one of the files")
        if n in extra or n in ("valid", "test", "train"):
            raise ValueError(f"config data.train_path: source {blend[i][1]!r} is named {n!r}, which data.valid_paths "
                             f"(or a split) already uses for val_loss_{n}; drop it from data.valid_paths (its held-out "
                             f"split is logged as a blend source) or rename the file")
    return names


def check_eval_batches(cfg: Config, valid: dict[str, GPTDataset | BlendedDataset]) -> None:
    """Refuse an evaluation longer than a held-out set: ``training.eval_batches`` micro-batches
    would cycle through the same windows again and again (the mean does not change; the time does)."""
    t = cfg.training
    for name, ds in valid.items():
        if t.eval_batches * t.micro_batch_size > len(ds):
            most = len(ds) // t.micro_batch_size
            fix = (f"set training.eval_batches <= {most}" if most else
                   f"set training.micro_batch_size <= {len(ds)} or hold out more text (data.split)")
            if any(corpus_name(p) == name for p in cfg.data.valid_paths):
                where = f"data.valid_paths entry {name!r}"
            else:
                where = "the held-out split of data.train_path" + ("" if name == "valid" else f" source {name!r}")
            raise ValueError(f"config training.eval_batches={t.eval_batches} x training.micro_batch_size="
                             f"{t.micro_batch_size} = {t.eval_batches * t.micro_batch_size} sequences, but {where} has "
                             f"only {len(ds)} windows of training.seq_len={t.seq_len} tokens; {fix}")
