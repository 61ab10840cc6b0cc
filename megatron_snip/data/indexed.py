"""Megatron-LM's memory-mapped indexed dataset (``prefix.bin`` + ``prefix.idx``), byte for byte.

Files written here are read by Megatron-LM's ``IndexedDataset`` and vice versa.

``prefix.bin``: the token arrays of all sequences back to back, dtype as in the header.

``prefix.idx`` (little endian), as Megatron's ``_IndexWriter`` writes it:

    offset  size        field
    0       9           magic  b"MMIDIDX\\x00\\x00"
    9       8   <Q      version = 1
    17      1   <B      dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                    6 float64, 7 float32, 8 uint16)
    18      8   <Q      sequence_count  S
    26      8   <Q      document_count  D + 1   (= number of document-index entries)
    34      4*S int32   sequence lengths (tokens)
    ..      8*S int64   sequence pointers (byte offset of each sequence in .bin)
    ..      8*(D+1) int64 document indices: 0, then the end (exclusive) sequence index of each
                        document, so document d is sequences [doc_idx[d], doc_idx[d+1])

Note the header's "document count" is the number of *entries* (documents + 1), as Megatron
writes ``len(document_indices)``. Our preprocessing stores one sequence per document.

``prefix.idx.fingerprint`` (JSON, ours; Megatron never opens it): the ``.bin`` this index was
written for - its size and the sha256 of its first and last ``FINGERPRINT_BLOCK`` bytes. An index
only describes lengths, so a different ``.bin`` of the same size would otherwise be read as if it
were the right one; opening checks the fingerprint when the file is there (indexes written by
Megatron or by older versions have none and load as before).

What the fingerprint does not see, by design (it costs two 1 MiB reads, not a pass over the file):
a ``.bin`` changed only between its first and last MiB; and without the sidecar, any other
``.bin`` of the right size. ``weak_check_note`` says which applies to a file (the data pipeline
logs it once per corpus); ``data.verify_full_hash`` closes both with ``check_full_hash``: the
whole ``.bin``'s sha256 against ``prefix.bin.sha256`` (``sha256sum`` format: ``<hex>  <name>``),
which the builder writes and ``sha256sum prefix.bin > prefix.bin.sha256`` records for any file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from collections.abc import Sequence
from typing import Self

import numpy as np

from megatron_snip.atomic_io import file_sha256

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # = 34

# Megatron's DType enum (megatron/core/datasets/indexed_dataset.py).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE: dict[np.dtype, int] = {v: k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits comfortably (vocab < 65500), else int32 -- Megatron's rule."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


FINGERPRINT_BLOCK = 1 << 20


def fingerprint_path(prefix: str | os.PathLike) -> str:
    return idx_path(prefix) + ".fingerprint"


def bin_fingerprint(path: str | os.PathLike) -> dict[str, object]:
    """A cheap identity of a ``.bin``: its size and the sha256 of its first and last blocks."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(FINGERPRINT_BLOCK)
        f.seek(max(size - FINGERPRINT_BLOCK, 0))
        tail = f.read(FINGERPRINT_BLOCK)
    return {"bin_bytes": size, "block_bytes": FINGERPRINT_BLOCK, "head_sha256": hashlib.sha256(head).hexdigest(),
            "tail_sha256": hashlib.sha256(tail).hexdigest()}


def check_fingerprint(prefix: str | os.PathLike) -> None:
    """Refuse a ``.bin`` that is not the one ``prefix.idx`` was written for (when the index has a fingerprint)."""
    fpath = fingerprint_path(prefix)
    if not os.path.isfile(fpath):
        return
    try:
        with open(fpath, encoding="utf-8") as f:
            recorded = json.load(f)
        block = int(recorded["block_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{fpath} is unreadable ({type(e).__name__}: {e}); delete it to skip the check, or rebuild "
                         f"the dataset with scripts/preprocess_data.py") from None
    if block != FINGERPRINT_BLOCK:
        return  # written with another block size: cannot compare cheaply
    got = bin_fingerprint(bin_path(prefix))
    if got != recorded:
        diff = [k for k in got if got[k] != recorded.get(k)]
        raise ValueError(f"{bin_path(prefix)} is not the .bin that {idx_path(prefix)} was written for: its {', '.join(diff)} "
                         f"differ from {fpath} ({', '.join(f'{k} {recorded.get(k)} -> {got[k]}' for k in diff)}); "
                         f"restore the matching .bin, or rebuild both with scripts/preprocess_data.py")


def sha256_path(prefix: str | os.PathLike) -> str:
    """The whole-``.bin`` checksum sidecar (``sha256sum`` format) that ``data.verify_full_hash`` checks."""
    return bin_path(prefix) + ".sha256"


def weak_check_note(prefix: str | os.PathLike) -> str:
    """One line saying what opening ``prefix`` does not check about its ``.bin`` (see the module
    docstring) and how to check it all."""
    b, fix = bin_path(prefix), "data.verify_full_hash=true checks every byte against " + sha256_path(prefix)
    if not os.path.isfile(fingerprint_path(prefix)):
        return (f"data: {idx_path(prefix)} has no fingerprint sidecar (written by Megatron or an older version): "
                f"{b} is checked only for its size, so another .bin of the same size would be read as this one; {fix}")
    return (f"data: {b} is checked against {fingerprint_path(prefix)} (its size and first/last "
            f"{FINGERPRINT_BLOCK >> 20} MiB): a change only between those is not detected; {fix}")


_SHA256_LINE = re.compile(r"^([0-9a-fA-F]{64})(\s|$)")


def check_full_hash(prefix: str | os.PathLike, what: str) -> None:
    """``data.verify_full_hash``: refuse a ``.bin`` whose whole sha256 is not the one recorded in
    ``sha256_path(prefix)``, or that has no such record (``what`` names the corpus in the message).
    Reads every byte once."""
    b, side = bin_path(prefix), sha256_path(prefix)
    record = f"record it with `sha256sum {b} > {side}` from a .bin you trust, or set data.verify_full_hash=false"
    if not os.path.isfile(side):
        raise ValueError(f"config data.verify_full_hash=true: {what}: {side} is missing, so {b} cannot be checked; "
                         f"{record} (scripts/preprocess_data.py writes it)")
    with open(side, encoding="utf-8", errors="replace") as f:
        m = _SHA256_LINE.match(f.readline().strip())
    if m is None:
        raise ValueError(f"config data.verify_full_hash=true: {what}: {side} does not start with a 64-digit hex "
                         f"sha256; {record}")
    recorded, got = m.group(1).lower(), file_sha256(b)
    if got != recorded:
        raise ValueError(f"config data.verify_full_hash=true: {what}: {b} has sha256 {got[:16]}..., not the "
                         f"{recorded[:16]}... recorded in {side}: the file changed after it was recorded; restore it, "
                         f"or rebuild it with scripts/preprocess_data.py")


def exists(prefix: str | os.PathLike) -> bool:
    """True when both ``prefix.idx`` and ``prefix.bin`` exist."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def publish(tmp_path: str, final_path: str) -> None:
    """Give a finished temp file normal permissions (mkstemp makes it 0600, unreadable to other
    users) and rename it into place atomically: readers see the old file or the whole new one."""
    os.chmod(tmp_path, 0o644)
    os.replace(tmp_path, final_path)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), dtype=np.int64)
    if len(x) > 1:
        np.cumsum(x[:-1], dtype=np.int64, out=out[1:])
    return out


class IndexedDatasetBuilder:
    """Writes ``prefix.bin``/``prefix.idx`` atomically (temp files + rename in ``finalize``).

    Use as a context manager: a clean exit finalizes, an exception removes the temp files and
    leaves any existing dataset at ``prefix`` untouched.

        with IndexedDatasetBuilder("out/corpus", optimal_dtype(tok.vocab_size)) as b:
            for ids in docs:
                b.add_document(ids)
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32) -> None:
        dtype = np.dtype(dtype)
        if dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype={dtype} is not one of Megatron's index dtypes {sorted(str(d) for d in CODE_OF_DTYPE)}")
        self.prefix = os.fspath(prefix)
        self.dtype = dtype
        folder = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(folder, exist_ok=True)
        base = os.path.basename(self.prefix)
        fd, self._bin_tmp = tempfile.mkstemp(dir=folder, prefix=base + ".bin.tmp")
        self._bin_file = os.fdopen(fd, "wb")
        self._idx_tmp: str | None = None
        self._fp_tmp: str | None = None
        self._sha_tmp: str | None = None
        self._bin_hash = hashlib.sha256()  # of the bytes as written: the sidecar costs no second pass
        self._sequence_lengths: list[int] = []
        self._document_indices: list[int] = [0]
        self._done = False
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            self._range = (int(info.min), int(info.max))
        else:
            self._range = None

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """Append one document.

        Args:
            tokens: (N,) token ids of the whole document (cast to the builder's dtype).
            lengths: how the N tokens split into sequences (Megatron's sentence split); default
                one sequence of N tokens.
        """
        if self._done:
            raise RuntimeError("add_document after finalize/abort")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if self._range is not None and arr.size and (int(arr.min()) < self._range[0] or int(arr.max()) > self._range[1]):
            raise ValueError(
                f"token ids in [{int(arr.min())}, {int(arr.max())}] do not fit dtype {self.dtype}; "
                f"use optimal_dtype(vocab_size) or a wider dtype such as int32"
            )
        lengths = [arr.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != arr.size or any(n < 0 for n in lengths):
            raise ValueError(f"lengths={lengths} must be non-negative and sum to len(tokens)={arr.size}")
        data = arr.astype(self.dtype, copy=False).tobytes(order="C")
        self._bin_file.write(data)
        self._bin_hash.update(data)
        self._sequence_lengths.extend(lengths)
        self._document_indices.append(len(self._sequence_lengths))

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    def finalize(self) -> str:
        """Write the index and move both files into place; returns the prefix."""
        if self._done:
            raise RuntimeError("finalize called twice")
        self._bin_file.close()
        lengths = np.asarray(self._sequence_lengths, dtype=np.int32)
        pointers = _exclusive_cumsum(lengths) * np.int64(self.dtype.itemsize)
        doc_idx = np.asarray(self._document_indices, dtype=np.int64)
        folder = os.path.dirname(os.path.abspath(self.prefix))
        fd, self._idx_tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(self.prefix) + ".idx.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(INDEX_HEADER)
                f.write(struct.pack("<Q", INDEX_VERSION))
                f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
                f.write(struct.pack("<Q", len(lengths)))
                f.write(struct.pack("<Q", len(doc_idx)))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(doc_idx.astype("<i8").tobytes())
            # .bin first, then its fingerprint and sha256, then .idx: a reader that sees the new
            # .idx also sees its .bin and both sidecars.
            publish(self._bin_tmp, bin_path(self.prefix))
            fd, self._fp_tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(self.prefix) + ".fp.tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(bin_fingerprint(bin_path(self.prefix)), f)
            publish(self._fp_tmp, fingerprint_path(self.prefix))
            fd, self._sha_tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(self.prefix) + ".sha.tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(f"{self._bin_hash.hexdigest()}  {os.path.basename(bin_path(self.prefix))}\n")
            publish(self._sha_tmp, sha256_path(self.prefix))
            publish(self._idx_tmp, idx_path(self.prefix))
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self.prefix

    def abort(self) -> None:
        """Drop the temp files; nothing at ``prefix`` changes."""
        self._done = True
        if not self._bin_file.closed:
            self._bin_file.close()
        for p in (self._bin_tmp, self._idx_tmp, self._fp_tmp, self._sha_tmp):
            if p is not None and os.path.exists(p):
                os.unlink(p)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron ``prefix.bin``/``prefix.idx`` pair.

    ``ds[i]`` is sequence i as a (length,) numpy view into the mapped ``.bin`` (no copy);
    ``ds.tokens`` is the whole ``.bin`` as one flat array. Pickles by prefix (a worker process
    re-maps the files instead of copying them).
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self._open()

    def _open(self) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        if not exists(self.prefix):
            raise ValueError(f"indexed dataset prefix={self.prefix!r}: {ipath} and/or {bpath} not found; build it with scripts/preprocess_data.py")
        size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[:9] != INDEX_HEADER:
            raise ValueError(f"{ipath} is not a Megatron MMIDIDX index (bad magic or truncated header)")
        (version,) = struct.unpack("<Q", head[9:17])
        (code,) = struct.unpack("<B", head[17:18])
        (n_seq,) = struct.unpack("<Q", head[18:26])
        (n_doc_entries,) = struct.unpack("<Q", head[26:34])
        if version != INDEX_VERSION:
            raise ValueError(f"{ipath}: index version {version} is not supported (expected {INDEX_VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{ipath}: dtype code {code} is not one of Megatron's codes {sorted(DTYPE_CODES)}")
        expected = _HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc_entries
        # Megatron's multimodal variant appends one int8 mode per sequence; tolerate it.
        if size not in (expected, expected + n_seq):
            raise ValueError(f"{ipath}: file is {size} bytes but its header implies {expected}; the index is corrupt or truncated")
        self.dtype = DTYPE_CODES[code]
        idx = np.memmap(ipath, dtype=np.uint8, mode="r") if size else np.empty(0, np.uint8)
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=n_doc_entries, offset=off)
        self._idx_map = idx

        if n_doc_entries < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n_seq or np.any(np.diff(self.document_indices) < 0):
            raise ValueError(f"{ipath}: document indices must start at 0, be non-decreasing and end at the sequence count {n_seq}")
        if n_seq and int(self.sequence_lengths.min()) < 0:
            i = int(np.argmin(self.sequence_lengths))
            raise ValueError(f"{ipath}: sequence {i} has negative length {int(self.sequence_lengths[i])}; the index "
                             f"is corrupt - rebuild it with scripts/preprocess_data.py")
        # Our readers address tokens by offset, which needs sequences packed back to back --
        # what every Megatron writer (including add_index merges) produces.
        itemsize = self.dtype.itemsize
        self._token_offsets = _exclusive_cumsum(self.sequence_lengths)
        if not np.array_equal(self.sequence_pointers, self._token_offsets * itemsize):
            implied = [d for d in DTYPE_CODES.values() if d.itemsize != itemsize
                       and np.array_equal(self.sequence_pointers, self._token_offsets * d.itemsize)]
            if implied:
                raise ValueError(f"{ipath}: the header's dtype code {code} ({self.dtype}, {itemsize}-byte tokens) "
                                 f"disagrees with the sequence pointers, which imply {implied[0].itemsize}-byte tokens; "
                                 f"the dtype byte (offset 17) is wrong - rebuild the index with scripts/preprocess_data.py")
            raise ValueError(f"{ipath}: sequence pointers are not contiguous; this reader needs packed sequences")
        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bsize = os.path.getsize(bpath)
        if bsize != n_tokens * itemsize:
            raise ValueError(f"{bpath} is {bsize} bytes but the index says {n_tokens} tokens of {self.dtype} ({n_tokens * itemsize} bytes)")
        check_fingerprint(self.prefix)
        # np.memmap cannot map an empty file.
        self.tokens = np.memmap(bpath, dtype=self.dtype, mode="r") if n_tokens else np.empty(0, self.dtype)

    def token_range(self, chunk: int = 1 << 24) -> tuple[int, int]:
        """(min, max) token id over the whole ``.bin`` (one chunked pass); (0, -1) when empty."""
        lo, hi = None, None
        for start in range(0, self.num_tokens, chunk):
            block = self.tokens[start:start + chunk]
            b_lo, b_hi = int(block.min()), int(block.max())
            lo, hi = (b_lo, b_hi) if lo is None else (min(lo, b_lo), max(hi, b_hi))
        return (0, -1) if lo is None else (lo, hi)

    # --- pickling: re-open by prefix rather than copying the mapped arrays
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        """Number of sequences (equal to documents for files written by our preprocessing)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx):
        """Sequence ``idx`` as a (length,) array view; a contiguous slice gives a list of them."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slice step={step}: only contiguous slices are supported")
            return [self[i] for i in range(start, stop)]
        i = int(idx)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence index {idx} out of range for {len(self)} sequences")
        i %= len(self)
        start = int(self._token_offsets[i])
        return self.tokens[start : start + int(self.sequence_lengths[i])]

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        seq = self[idx]
        if not 0 <= offset <= len(seq):
            raise IndexError(f"offset={offset} out of range for sequence {idx} of length {len(seq)}")
        end = len(seq) if length is None else offset + length
        if length is not None and (length < 0 or end > len(seq)):
            raise IndexError(f"length={length} from offset={offset} runs past sequence {idx} of length {len(seq)}")
        return seq[offset:end]

    def document_token_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends), each (num_documents,) int64: token offsets of each document in ``tokens``."""
        seq_starts = np.append(self._token_offsets, np.int64(self.num_tokens))
        return seq_starts[self.document_indices[:-1]], seq_starts[self.document_indices[1:]]

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, docs={self.num_documents}, seqs={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"
