"""Corpora: JSONL text files, the samples bundled in the package, tokenize-once caching, stats.

JSONL layout (Megatron's preprocessing convention): one JSON object per line with the document
text under a key (default "text"), e.g. ``{"id": "chapter_1", "text": "..."}``; plain or gzip.

Bundled samples (``megatron_snip/data/sample/``, public domain, see the README there):
  * ``sotu``      -- State of the Union addresses (a spread of years), the training sample.
  * ``moby_dick`` -- opening chapters of Moby-Dick, a held-out second domain for validation.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import multiprocessing
import os
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from megatron_snip.atomic_io import file_sha256
from megatron_snip.data.indexed import IndexedDatasetBuilder, exists, optimal_dtype, publish
from megatron_snip.data.tokenizer import Tokenizer

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
BUNDLED_SAMPLES: dict[str, str] = {
    "sotu": "sotu_sample.jsonl.gz",
    "moby_dick": "moby_dick_sample.jsonl.gz",
}
# Bump when the token-file layout written by prepare_tokens changes, to invalidate caches.
_CACHE_FORMAT = "v1"


def bundled_sample_path(name: str) -> str:
    """Path of a corpus sample shipped inside the package (``"sotu"`` or ``"moby_dick"``)."""
    if name not in BUNDLED_SAMPLES:
        raise ValueError(f"bundled sample name={name!r} is unknown; use one of {sorted(BUNDLED_SAMPLES)}")
    path = SAMPLE_DIR / BUNDLED_SAMPLES[name]
    if not path.is_file():
        raise ValueError(f"bundled sample {name!r} is missing at {path}; reinstall the package (setup.py package_data must include data/sample/*)")
    return str(path)


def _open_text(path: str | os.PathLike, mode: str = "rt"):
    path = os.fspath(path)
    if path.endswith(".gz"):
        return gzip.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _numbered_lines(f, path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of an open text file, with decoding errors turned into messages naming the file."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, 1):
            yield lineno, line
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a valid gzip file ({type(e).__name__}: {e}); a .gz name needs gzip-compressed "
                         f"JSONL - gzip it, or drop the .gz suffix if it is plain text") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason} at byte {e.start} of the line's chunk); "
                         f"give JSONL text, one {{\"text\": ...}} object per line") from None


def read_jsonl(path: str | os.PathLike, key: str = "text") -> Iterator[str]:
    """The ``key`` field of each JSON line of ``path`` (plain or ``.gz``); blank lines skipped."""
    if not os.path.isfile(path):
        raise ValueError(f"jsonl path={os.fspath(path)!r} does not exist")
    with _open_text(path) as f:
        for lineno, line in _numbered_lines(f, os.fspath(path)):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{os.fspath(path)}:{lineno}: no {key!r} field; each line must be an object like {{\"{key}\": \"...\"}} (or pass json_key=)")
            text = obj[key]
            if not isinstance(text, str):
                # ValueError, not TypeError: a wrong type here is bad user input, which the house reports as ValueError
                raise ValueError(f"{os.fspath(path)}:{lineno}: field {key!r} is {type(text).__name__}, expected a string")  # noqa: TRY004
            yield text


def write_jsonl(records: Iterable[Mapping], path: str | os.PathLike) -> int:
    """Write one JSON object per line (gzip if ``path`` ends in .gz), atomically; returns the count.

    ``json.dumps`` defaults (ASCII-escaped), the layout ``scripts/prepare_corpus.py`` writes.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".tmp")
    n = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            # mtime=0 keeps .gz output byte-identical across runs.
            stream = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) if path.endswith(".gz") else raw
            with io.TextIOWrapper(stream, encoding="utf-8", newline="\n") as f:
                for rec in records:
                    f.write(json.dumps(dict(rec)) + "\n")
                    n += 1
            if stream is not raw:
                stream.close()
        publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return n


# --- tokenization -----------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_tokenizer = tokenizer


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_batch(texts)


def _batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in items:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_to_indexed(
    texts: Iterable[str],
    tokenizer: Tokenizer,
    prefix: str | os.PathLike,
    append_eod: bool = True,
    workers: int = 1,
    batch_docs: int = 32,
    progress: bool = False,
) -> dict:
    """Tokenize documents into a Megatron ``prefix.bin/.idx`` (one sequence per document).

    Args:
        texts: documents, in order.
        append_eod: end each document with ``tokenizer.eod_id`` (Megatron's --append-eod).
        workers: >1 encodes in that many spawned processes (order is kept); 1 encodes here
            (BPE's ``encode_batch`` is already multi-threaded).
        batch_docs: documents per encode call.

    Returns:
        {"documents", "tokens", "text_bytes" (UTF-8), "seconds"}.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive int")
    t0 = time.perf_counter()
    n_docs = n_tokens = n_bytes = 0
    texts_iter = iter(texts)

    def counted(batches):
        nonlocal n_bytes
        for b in batches:
            n_bytes += sum(len(t.encode("utf-8")) for t in b)
            yield b

    batches = counted(_batched(texts_iter, batch_docs))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit="doc", desc=f"tokenize -> {os.path.basename(os.fspath(prefix))}")
    pool = None
    try:
        if workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,))
            encoded = pool.imap(_encode_in_worker, batches)
        else:
            encoded = (tokenizer.encode_batch(b) for b in batches)
        with IndexedDatasetBuilder(prefix, optimal_dtype(tokenizer.vocab_size)) as builder:
            eod = [tokenizer.eod_id] if append_eod else []
            for ids_batch in encoded:
                for ids in ids_batch:
                    builder.add_document(np.asarray(ids + eod, dtype=np.int64))
                    n_tokens += len(ids) + len(eod)
                n_docs += len(ids_batch)
                if bar is not None:
                    bar.update(len(ids_batch))
                    bar.set_postfix(tokens=n_tokens)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    return {"documents": n_docs, "tokens": n_tokens, "text_bytes": n_bytes, "seconds": time.perf_counter() - t0}


def cache_prefix(jsonl_path: str | os.PathLike, tokenizer: Tokenizer, cache_dir: str | os.PathLike, json_key: str = "text", append_eod: bool = True) -> str:
    """Where ``prepare_tokens`` keeps the tokens of this (file content, tokenizer, options)."""
    key = hashlib.sha256(
        f"{_CACHE_FORMAT}|{file_sha256(jsonl_path)}|{tokenizer.identity()}|{json_key}|{append_eod}".encode()
    ).hexdigest()[:20]
    stem = Path(jsonl_path).name.split(".")[0]
    return os.path.join(os.fspath(cache_dir), f"{stem}-{tokenizer.kind}-{key}")


def prepare_tokens(
    jsonl_path: str | os.PathLike,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike,
    json_key: str = "text",
    append_eod: bool = True,
    progress: bool = False,
) -> str:
    """Tokenize ``jsonl_path`` once and return the cached ``IndexedDataset`` prefix.

    The cache key is the file's sha256 + the tokenizer's identity + options, so an edited
    corpus or a different tokenizer gets new files and a repeated run only hashes the file.
    Concurrent callers (several ranks) are safe: files appear atomically, and two builders of
    the same key write the same bytes. Next to the prefix, ``prefix.json`` records the stats.
    """
    prefix = cache_prefix(jsonl_path, tokenizer, cache_dir, json_key, append_eod)
    if exists(prefix):
        return prefix
    stats = tokenize_to_indexed(read_jsonl(jsonl_path, json_key), tokenizer, prefix, append_eod=append_eod, progress=progress)
    meta = {"source": os.path.abspath(jsonl_path), "tokenizer": tokenizer.kind, "tokenizer_identity": tokenizer.identity(),
            "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id, "json_key": json_key, "append_eod": append_eod, **stats}
    fd, tmp = tempfile.mkstemp(dir=os.fspath(cache_dir), prefix=os.path.basename(prefix) + ".json.tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, indent=1)
    publish(tmp, prefix + ".json")
    return prefix


# --- statistics -------------------------------------------------------------------------------

def token_counts(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """(vocab_size,) int64 occurrence counts of ``tokens``."""
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Plug-in entropy (nats/token) of the tokens' own unigram distribution -- a lower bound
    for any unigram model of this text."""
    counts = token_counts(tokens, vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_cross_entropy(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int, alpha: float = 1.0) -> float:
    """Nats/token of ``eval_tokens`` under an add-``alpha`` unigram model fit on ``train_tokens``:
    the loss a language model must beat to have learned more than token frequencies."""
    counts = token_counts(train_tokens, vocab_size).astype(np.float64) + alpha
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(eval_tokens, dtype=np.int64)].mean())
