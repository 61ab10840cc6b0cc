"""GPT pretraining samples: fixed-length windows over a document stream, indexed by sample number.

The token stream of a dataset is its documents (a subset of an ``IndexedDataset``, in file
order) concatenated, each followed by exactly one EOD: files built by our preprocessing already
end every document with EOD (Megatron's ``--append-eod``); for files that do not, the EOD is
inserted virtually at read time. With ``T`` stream tokens and sequence length ``s`` there are
``W = (T - 1) // s`` windows per epoch; window ``w`` is stream tokens ``[w*s, w*s + s + 1)``
(consecutive windows share one token, as in Megatron), so input = ``x[:, :-1]`` and
target = ``x[:, 1:]``.

Samples are addressed by a *global sample index* ``g >= 0``: epoch ``g // W``, and within the
epoch a seeded permutation of the windows (a new one each epoch; identity when shuffle=False).
So ``dataset.batch(start, n)`` is a pure function of (files, documents, seq_len, seed, start, n):
a run that saved "samples consumed" resumes exactly by asking for the next indices.

Data parallelism (``GPTBatchLoader``) follows Megatron's pretraining sampler: a global batch of
``G = micro * num_micro * dp_size`` samples starting at ``consumed`` is cut into ``num_micro``
chunks of ``micro * dp_size``, and rank ``r`` takes ``[r*micro, (r+1)*micro)`` of each chunk.
Ranks get disjoint slices whose union is the global batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from megatron_snip.data.indexed import IndexedDataset


def parse_split(split: str) -> tuple[float, float, float]:
    """``"98,2"`` or ``"969,30,1"`` -> normalized (train, valid, test) fractions."""
    try:
        weights = [float(w) for w in str(split).split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 or not np.isfinite(w) for w in weights) or sum(weights) <= 0 or weights[0] <= 0:
        raise ValueError(
            f"split={split!r} must be 1-3 comma-separated non-negative weights train,valid[,test] "
            f"with a positive train weight, e.g. '98,2' or '969,30,1'"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def split_documents(num_documents: int, split: str, seed: int = 1234) -> dict[str, np.ndarray]:
    """Assign documents to train/valid/test at random (seeded), so no text is in two splits.

    Random rather than contiguous blocks (Megatron's choice) because our corpora are ordered
    (chronological speeches, chapters); a tail block would make validation a different era.

    Returns:
        {"train", "valid", "test"} -> sorted int64 document ids (possibly empty for valid/test).
        A positive valid/test weight gets at least one document when there are enough.
    """
    _, f_valid, f_test = parse_split(split)
    n_valid = round(f_valid * num_documents)
    n_test = round(f_test * num_documents)
    if f_valid > 0 and n_valid == 0 and num_documents >= 2:
        n_valid = 1
    if f_test > 0 and n_test == 0 and num_documents >= 3:
        n_test = 1
    n_train = num_documents - n_valid - n_test
    if n_train < 1:
        raise ValueError(
            f"split={split!r} leaves no training documents out of {num_documents}; "
            f"use a larger corpus or a larger train weight"
        )
    perm = np.random.default_rng([seed, 0x5EED]).permutation(num_documents)
    return {
        "valid": np.sort(perm[:n_valid]).astype(np.int64),
        "test": np.sort(perm[n_valid : n_valid + n_test]).astype(np.int64),
        "train": np.sort(perm[n_valid + n_test :]).astype(np.int64),
    }


class GPTDataset:
    """Windows of ``seq_len + 1`` tokens over the documents' EOD-separated stream.

    Args:
        indexed: the token files.
        seq_len: model sequence length s; each sample has s + 1 tokens.
        eod_id: the tokenizer's end-of-document id.
        documents: sorted document ids to use (default: all), e.g. from ``split_documents``.
        seed: window-order seed; epoch e uses permutation rng([seed, e]).
        shuffle: False keeps windows in stream order (validation).
        label: what the user called this data (e.g. ``config data.train_path source 'a.jsonl'``),
            for the error when it holds less than one window.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        eod_id: int,
        documents: np.ndarray | None = None,
        seed: int = 1234,
        shuffle: bool = True,
        label: str = "",
    ) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be a positive int")
        self.indexed = indexed
        self.seq_len = seq_len
        self.eod_id = int(eod_id)
        self.seed = int(seed)
        self.shuffle = shuffle
        starts, ends = indexed.document_token_ranges()
        if documents is None:
            documents = np.arange(indexed.num_documents, dtype=np.int64)
        documents = np.asarray(documents, dtype=np.int64)
        if documents.size and (documents.min() < 0 or documents.max() >= indexed.num_documents):
            raise ValueError(f"documents must be ids in [0, {indexed.num_documents}), got range [{documents.min()}, {documents.max()}]")
        self.documents = documents
        doc_start, doc_len = starts[documents], ends[documents] - starts[documents]
        keep = doc_len > 0  # empty documents contribute nothing, not even an EOD
        doc_start, doc_len = doc_start[keep], doc_len[keep]
        last = indexed.tokens[doc_start + doc_len - 1] if doc_len.size else np.empty(0, np.int64)
        self._seg_file_start = doc_start
        self._seg_doc_len = doc_len
        seg_len = doc_len + (last != self.eod_id)  # +1 where the EOD must be inserted
        self._seg_stream_start = np.zeros(len(seg_len), np.int64)
        np.cumsum(seg_len[:-1], out=self._seg_stream_start[1:])
        self.num_tokens = int(seg_len.sum())
        self.num_windows = max((self.num_tokens - 1) // seq_len, 0)
        if self.num_windows < 1:
            raise ValueError(
                f"{label or 'corpus'} ({indexed.prefix}.bin): the selected {len(documents)} documents hold "
                f"{self.num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1} (training.seq_len); use a shorter "
                f"training.seq_len or give it more text"
            )
        self._perm_cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        """Windows per epoch."""
        return self.num_windows

    def stream(self, positions: np.ndarray) -> np.ndarray:
        """Stream tokens at ``positions`` (any shape, int64 in [0, num_tokens)) -> same shape, int64."""
        positions = np.asarray(positions, dtype=np.int64)
        seg = np.searchsorted(self._seg_stream_start, positions, side="right") - 1
        off = positions - self._seg_stream_start[seg]
        doc_len = self._seg_doc_len[seg]
        is_eod = off >= doc_len  # the virtual EOD after a document stored without one
        tokens = self.indexed.tokens[self._seg_file_start[seg] + np.minimum(off, doc_len - 1)].astype(np.int64)
        return np.where(is_eod, self.eod_id, tokens)

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_cache[epoch] = perm
            if len(self._perm_cache) > 2:  # a batch spans at most two epochs
                self._perm_cache.popitem(last=False)
        return perm

    def window_ids(self, sample_indices: np.ndarray) -> np.ndarray:
        """Global sample indices (N,) -> window ids (N,) in [0, num_windows)."""
        sample_indices = np.asarray(sample_indices, dtype=np.int64)
        if sample_indices.size and sample_indices.min() < 0:
            raise ValueError(f"sample indices must be >= 0, got {int(sample_indices.min())}")
        epoch, within = np.divmod(sample_indices, self.num_windows)
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._permutation(int(e))[within[sel]]
        return out

    def batch(self, start_sample: int, batch_size: int) -> torch.Tensor:
        """Samples ``[start_sample, start_sample + batch_size)`` -> (batch_size, seq_len + 1) int64."""
        if start_sample < 0 or batch_size < 0:
            raise ValueError(f"start_sample={start_sample} and batch_size={batch_size} must be >= 0")
        return self.samples(np.arange(start_sample, start_sample + batch_size, dtype=np.int64))

    def samples(self, sample_indices: np.ndarray) -> torch.Tensor:
        """Global sample indices (N,) -> (N, seq_len + 1) int64 (any order, e.g. a blend's picks)."""
        windows = self.window_ids(sample_indices)
        positions = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)[None, :]
        return torch.from_numpy(self.stream(positions))

    def __getitem__(self, sample: int) -> torch.Tensor:
        """One sample, (seq_len + 1,) int64."""
        return self.batch(int(sample), 1)[0]

    def __repr__(self) -> str:
        return (f"GPTDataset(docs={len(self.documents)}, tokens={self.num_tokens}, seq_len={self.seq_len}, "
                f"windows/epoch={self.num_windows}, shuffle={self.shuffle}, seed={self.seed})")


def spread_windows(num_windows: int, count: int) -> np.ndarray:
    """``count`` window ids evenly spaced over ``[0, num_windows)`` - the middle of each of ``count``
    equal slices - or every window when ``count >= num_windows``; (min(count, num_windows),) int64,
    ascending and distinct. An evaluation over them measures the whole split, not its first pages."""
    if num_windows < 0 or count < 0:
        raise ValueError(f"num_windows={num_windows} and count={count} must be >= 0")
    if count >= num_windows:
        return np.arange(num_windows, dtype=np.int64)
    return ((2 * np.arange(count, dtype=np.int64) + 1) * num_windows) // (2 * count)


def eval_window_batches(ds: GPTDataset, batches: int, size: int, windows: str = "first") -> list[torch.Tensor]:
    """The periodic evaluation's batches of one validation set, each (size, seq_len + 1) int64:
    ``"first"``: samples [0, batches * size) in order (the first windows of an unshuffled set);
    ``"spread"``: ``spread_windows`` of ``batches * size`` over the set. Either way cut to whole
    batches of distinct windows: a set smaller than ``batches * size`` gives fewer batches (all of
    its windows that fill one), never a window twice."""
    out = list(eval_micro_batches(ds, size, max_samples=batches * size, windows=windows))
    if not out:
        raise ValueError(f"a validation set holds {ds.num_windows} windows, fewer than one batch of "
                         f"training.micro_batch_size={size}; lower it or give the set more text")
    return out


def micro_batch_start(consumed_samples: int, micro_index: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> int:
    """First global sample index of micro-batch ``micro_index`` of data-parallel rank ``dp_rank``
    in the global batch that starts at ``consumed_samples`` (Megatron's sampler layout)."""
    return consumed_samples + (micro_index * dp_size + dp_rank) * micro_batch_size


class GPTBatchLoader:
    """This rank's micro-batches, one global batch at a time, resumable from ``consumed_samples``.

    Args:
        dataset: the samples.
        micro_batch_size: samples per micro-batch on this rank.
        num_micro_batches: gradient-accumulation steps per optimizer step.
        dp_rank, dp_size: position in the data-parallel group (all TP/PP ranks of one DP
            replica pass the same dp_rank and so read the same samples).
        consumed_samples: global samples already consumed (from the checkpoint).

    ``global_batch_size = micro_batch_size * num_micro_batches * dp_size``.
    """

    def __init__(
        self,
        dataset: GPTDataset,
        micro_batch_size: int,
        num_micro_batches: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
    ) -> None:
        for name, v in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches), ("dp_size", dp_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank!r} must be in [0, dp_size={dp_size})")
        if not isinstance(consumed_samples, int) or consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples!r} must be a non-negative int")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.dp_size

    def micro_batches(self, consumed_samples: int) -> list[torch.Tensor]:
        """This rank's ``num_micro_batches`` tensors (micro_batch_size, seq_len + 1) int64 for the
        global batch starting at ``consumed_samples``; does not change the loader's position."""
        return [
            self.dataset.batch(micro_batch_start(consumed_samples, k, self.micro_batch_size, self.dp_rank, self.dp_size), self.micro_batch_size)
            for k in range(self.num_micro_batches)
        ]

    def next(self) -> list[torch.Tensor]:
        """The next global batch's micro-batches for this rank; advances ``consumed_samples``."""
        out = self.micro_batches(self.consumed_samples)
        self.consumed_samples += self.global_batch_size
        return out

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: Mapping) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def eval_micro_batches(
    dataset: GPTDataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, max_samples: int | None = None,
    windows: str = "first",
) -> Iterator[torch.Tensor]:
    """One pass over ``max_samples`` samples (default: one epoch), cut as in training: this rank's
    (micro_batch_size, seq_len + 1) tensors; the tail that does not fill a batch on every rank is
    dropped so all ranks run the same number of steps. ``windows`` as ``training.eval_windows``:
    ``"first"`` reads the first samples in order, ``"spread"`` the ``spread_windows`` over the whole
    set (with one rank and ``max_samples`` = batches x micro_batch_size: the training evaluation's
    windows and batches, ``eval_window_batches``)."""
    n = dataset.num_windows if max_samples is None else min(max_samples, dataset.num_windows)
    if windows == "first":
        ids = np.arange(n, dtype=np.int64)
    elif windows == "spread":
        ids = spread_windows(dataset.num_windows, n)
    else:
        raise ValueError(f"windows={windows!r}: choose 'first' or 'spread'")
    step = micro_batch_size * dp_size
    for start in range(0, len(ids) - step + 1, step):
        first = micro_batch_start(start, 0, micro_batch_size, dp_rank, dp_size)
        yield dataset.samples(ids[first : first + micro_batch_size])  # batch(s, k) is samples(arange(s, s + k))


def build_datasets(
    indexed: IndexedDataset,
    seq_len: int,
    eod_id: int,
    split: str = "98,2",
    seed: int = 1234,
    extra_valid: Mapping[str, IndexedDataset] | None = None,
    label: str = "",
    shuffle_seed: int | None = None,
) -> dict[str, GPTDataset]:
    """Train/valid(/test) datasets by document split, plus whole-corpus validation sets.

    ``seed`` picks the held-out documents and, unless ``shuffle_seed`` is given, the training windows' order.

    Returns:
        "train" (shuffled with ``shuffle_seed``, else ``seed``), "valid" and "test" when their split weight gives
        them documents (in stream order), and one unshuffled dataset per ``extra_valid`` name
        (e.g. {"moby_dick": IndexedDataset(...)}) -- held-out corpora used whole. ``label`` names
        ``indexed`` in errors (its config field and path); ``extra_valid`` ones are data.valid_paths.
    """
    docs = split_documents(indexed.num_documents, split, seed)
    label = label or "corpus"
    order = seed if shuffle_seed is None else shuffle_seed
    out = {"train": GPTDataset(indexed, seq_len, eod_id, docs["train"], seed=order, shuffle=True,
                               label=f"{label} (its train split)")}
    for name in ("valid", "test"):
        if docs[name].size:
            out[name] = GPTDataset(indexed, seq_len, eod_id, docs[name], seed=seed, shuffle=False,
                                   label=f"{label} (its {name} split, data.split)")
    for name, ds in (extra_valid or {}).items():
        if name in out:
            raise ValueError(f"extra_valid name {name!r} clashes with a split name; rename it")
        out[name] = GPTDataset(ds, seq_len, eod_id, None, seed=seed, shuffle=False,
                               label=f"config data.valid_paths entry {name!r}")
    return out
