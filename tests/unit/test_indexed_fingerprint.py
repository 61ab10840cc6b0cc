"""An .idx paired with another .bin of the same byte size is refused (issue #26, section 2): the
index records a fingerprint of its .bin in a sidecar Megatron never opens; indexes without one
(Megatron's, older ones) still load."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from megatron_snip.data import indexed


def _build(prefix, docs):
    with indexed.IndexedDatasetBuilder(prefix, np.uint16) as b:
        for d in docs:
            b.add_document(np.asarray(d))
    return prefix


def test_a_bin_of_the_same_size_but_other_tokens_is_refused(tmp_path):
    a = _build(tmp_path / "a", [np.arange(100), np.arange(50)])
    b = _build(tmp_path / "b", [np.arange(100) + 7, np.arange(50) + 7])  # same lengths, other tokens
    assert os.path.getsize(indexed.bin_path(a)) == os.path.getsize(indexed.bin_path(b))
    assert os.path.isfile(indexed.fingerprint_path(a))
    indexed.IndexedDataset(a)  # its own .bin opens
    shutil.copyfile(indexed.bin_path(b), indexed.bin_path(a))
    with pytest.raises(ValueError, match=rf"{indexed.bin_path(a)} is not the .bin that {indexed.idx_path(a)} was written "
                                         r"for: its head_sha256, tail_sha256 differ .*restore the matching .bin, or "
                                         r"rebuild both with scripts/preprocess_data.py"):
        indexed.IndexedDataset(a)


def test_an_index_without_a_fingerprint_still_loads_and_megatron_sees_the_same_files(tmp_path):
    a = _build(tmp_path / "a", [np.arange(10)])
    # the .idx itself is Megatron's layout, unchanged: header + lengths + pointers + doc indices
    assert os.path.getsize(indexed.idx_path(a)) == 34 + 4 * 1 + 8 * 1 + 8 * 2
    os.remove(indexed.fingerprint_path(a))
    np.testing.assert_array_equal(indexed.IndexedDataset(a)[0], np.arange(10))
