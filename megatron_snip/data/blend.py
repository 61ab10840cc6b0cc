"""Blended corpora: one sample stream drawn from several datasets in fixed proportions.

Megatron's ``BlendedDataset`` semantics: global sample ``i`` comes from source
``dataset_index[i]``, as that source's sample ``dataset_sample_index[i]`` (its own shuffled
stream, epoch after epoch). The index is built greedily - sample ``i`` goes to the source whose
count lags its share the most, ``argmax_d(w_d * max(i, 1) - count_d)``, ties to the lowest ``d``
(Megatron's ``helpers.build_blending_indices``) - so after every prefix of ``n`` samples each
source's count is within one sample of ``w_d * n``.

The index of the first ``n`` samples does not depend on how many are built after them, so a run
that resumes (or trains longer) continues the same stream: ``BlendedDataset`` extends the index
in memory whenever a batch reaches past it. The part a run needs (``max_steps * global_batch``
samples) is built once and cached as ``blend_<hash>.npz`` in the data cache (where tokenized
corpora go), keyed by a sha256 of everything it describes (``index_description``).
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megatron_snip.atomic_io import atomic_write_bytes
from megatron_snip.data.dataset import GPTDataset

ALGORITHM = "megatron-blend-v1"  # part of the cache key: bump it if the index rule ever changes


def blending_indices(weights: Sequence[float], start: int, stop: int,
                     counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``[start, stop)`` of the blend: (dataset_index int16 (stop-start,), dataset_sample_index
    int64 (stop-start,)). ``counts`` (int64 (num_sources,)) are the samples each source gave to
    ``[0, start)`` (zeros when ``start`` is 0); they are advanced in place."""
    w = [float(x) for x in weights]
    k = len(w)
    c = [0] * k if counts is None else [int(x) for x in counts]
    if counts is None and start:
        raise ValueError("blending_indices: give the counts of [0, start) to continue an index")
    which = np.empty(stop - start, np.int16)
    local = np.empty(stop - start, np.int64)
    for j, i in enumerate(range(start, stop)):
        at = float(max(i, 1))
        best, best_err = 0, w[0] * at - c[0]
        for d in range(1, k):
            err = w[d] * at - c[d]
            if err > best_err:  # strict: ties go to the lower index, as in Megatron
                best, best_err = d, err
        which[j] = best
        local[j] = c[best]
        c[best] += 1
    if counts is not None:
        counts[:] = c
    return which, local


def index_description(weights: Sequence[float], sources: Sequence[GPTDataset], names: Sequence[str],
                      size: int) -> dict:
    """What the cached index stands for (its sha256 is the cache key)."""
    return {"algorithm": ALGORITHM, "size": int(size), "weights": [float(w) for w in weights],
            "sources": [{"name": n, "path": str(s.indexed.prefix), "documents": len(s.documents),
                         "tokens": s.num_tokens, "windows": s.num_windows, "seq_len": s.seq_len, "seed": s.seed}
                        for n, s in zip(names, sources, strict=True)]}


def cached_index(cache_dir: str | Path, description: dict, *, write: bool) -> tuple[np.ndarray, np.ndarray, Path]:
    """The index ``description`` stands for, read from ``cache_dir/blend_<hash>.npz`` or built (and
    written there when ``write``: the rank that prepares data). A cache file that does not hold
    exactly that description and a consistent index of its size is rebuilt, never trusted."""
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    path = Path(cache_dir) / f"blend_{key[:16]}.npz"
    size, weights = description["size"], description["weights"]
    try:
        with np.load(path, allow_pickle=False) as z:
            which, local, desc = z["dataset_index"], z["dataset_sample_index"], str(z["description"])
        if json.loads(desc) == description and _consistent(which, local, len(weights), size):
            return which, local, path
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # missing or damaged: rebuild
    which, local = blending_indices(weights, 0, size)
    if write:
        buf = io.BytesIO()
        np.savez(buf, dataset_index=which, dataset_sample_index=local,
                 description=np.array(json.dumps(description, sort_keys=True)))
        atomic_write_bytes(path, buf.getvalue())
    return which, local, path


def _consistent(which: np.ndarray, local: np.ndarray, num_sources: int, size: int) -> bool:
    """Shapes, range, and each source's samples numbered 0, 1, 2, ... in order."""
    if which.shape != (size,) or local.shape != (size,) or (size and not 0 <= which.min() <= which.max() < num_sources):
        return False
    for d in range(num_sources):
        got = local[which == d]
        if not np.array_equal(got, np.arange(got.size)):
            return False
    return True


class BlendedDataset:
    """Samples from ``sources`` in proportion to ``weights`` (normalized), addressed like a
    ``GPTDataset``: ``batch(start, n)`` -> (n, seq_len + 1) int64, a pure function of the sources,
    the weights and the sample numbers.

    Args:
        sources: the datasets (same seq_len), e.g. each corpus's training split.
        weights: one positive weight per source.
        names: one name per source (logs, the cache description).
        index: a precomputed prefix (dataset_index, dataset_sample_index), e.g. ``cached_index``'s.
    """

    def __init__(self, sources: Sequence[GPTDataset], weights: Sequence[float], names: Sequence[str],
                 index: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        if len(sources) != len(weights) or len(sources) != len(names) or not sources:
            raise ValueError(f"BlendedDataset: {len(sources)} sources, {len(weights)} weights, {len(names)} names")
        seq = {s.seq_len for s in sources}
        if len(seq) != 1:
            raise ValueError(f"BlendedDataset: sources have different seq_len {sorted(seq)}")
        total = float(sum(weights))
        self.sources, self.names = list(sources), list(names)
        self.weights = [float(w) / total for w in weights]
        self.seq_len = seq.pop()
        self.num_windows = sum(s.num_windows for s in sources)  # one pass over every source, for eval loops
        which, local = index if index is not None else (np.empty(0, np.int16), np.empty(0, np.int64))
        self._which, self._local = which, local
        self._counts = np.bincount(which.astype(np.int64), minlength=len(sources)).astype(np.int64)

    def __len__(self) -> int:
        return self.num_windows

    def _extend(self, stop: int) -> None:
        """Grow the index to at least ``stop`` samples (doubling), continuing the same greedy stream."""
        have = self._which.size
        if stop <= have:
            return
        new_stop = max(stop, 2 * have, 1024)
        which, local = blending_indices(self.weights, have, new_stop, self._counts)
        self._which = np.concatenate([self._which, which])
        self._local = np.concatenate([self._local, local])

    def source_of(self, sample_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample numbers (N,) -> (source (N,), the source's own sample number (N,))."""
        sample_indices = np.asarray(sample_indices, dtype=np.int64)
        if sample_indices.size and sample_indices.min() < 0:
            raise ValueError(f"sample indices must be >= 0, got {int(sample_indices.min())}")
        self._extend(int(sample_indices.max()) + 1 if sample_indices.size else 0)
        return self._which[sample_indices], self._local[sample_indices]

    def samples(self, sample_indices: np.ndarray) -> torch.Tensor:
        """Global sample numbers (N,) -> (N, seq_len + 1) int64."""
        which, local = self.source_of(sample_indices)
        out = torch.empty((which.size, self.seq_len + 1), dtype=torch.int64)
        for d, src in enumerate(self.sources):
            sel = np.flatnonzero(which == d)
            if sel.size:
                out[torch.from_numpy(sel)] = src.samples(local[sel])
        return out

    def batch(self, start_sample: int, batch_size: int) -> torch.Tensor:
        """Samples ``[start_sample, start_sample + batch_size)`` -> (batch_size, seq_len + 1) int64."""
        if start_sample < 0 or batch_size < 0:
            raise ValueError(f"start_sample={start_sample} and batch_size={batch_size} must be >= 0")
        return self.samples(np.arange(start_sample, start_sample + batch_size, dtype=np.int64))

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:.3f}" for n, w in zip(self.names, self.weights, strict=True))
        return f"BlendedDataset({parts}, seq_len={self.seq_len})"
