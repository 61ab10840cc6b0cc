"""data.shuffle_seed: the training windows' order apart from training.seed (init and held-out split)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.data.pipeline import build_data
from megatron_snip.training.resume_check import compare

TINY = "launch/configs/tiny.toml"


def _data(small_overrides, *extra):
    return build_data(load_config(TINY, [*small_overrides, "training.seed=5", *extra]))


def _epoch_windows(ds):
    return ds.window_ids(np.arange(len(ds)))


def test_default_order_follows_training_seed(small_overrides):
    """-1 (the default, every recorded run) is today's order: the same batches as a shuffle seed equal
    to training.seed, since both draw the permutation from rng([5, epoch])."""
    default, same = _data(small_overrides), _data(small_overrides, "data.shuffle_seed=5")
    assert torch.equal(default.train.batch(0, 64), same.train.batch(0, 64))


def test_another_shuffle_seed_reorders_the_same_windows_and_holds_out_the_same_text(small_overrides):
    default, other = _data(small_overrides), _data(small_overrides, "data.shuffle_seed=1011")
    assert not torch.equal(default.train.batch(0, 64), other.train.batch(0, 64))
    # the same training windows (the same documents), in another order, epoch after epoch
    assert np.array_equal(np.sort(_epoch_windows(default.train)), np.sort(_epoch_windows(other.train)))
    assert not np.array_equal(_epoch_windows(default.train), _epoch_windows(other.train))
    # held-out text is picked by training.seed alone
    assert set(default.valid) == set(other.valid)
    for name, ds in default.valid.items():
        assert torch.equal(ds.batch(0, len(ds)), other.valid[name].batch(0, len(ds)))


@pytest.mark.parametrize("value", ["-2", "4294967296", "1.5"])
def test_a_bad_shuffle_seed_is_refused_naming_the_field(small_overrides, value):
    with pytest.raises(ValueError, match="data.shuffle_seed"):
        load_config(TINY, [*small_overrides, f"data.shuffle_seed={value}"])


def test_resuming_with_another_shuffle_seed_is_refused(small_overrides):
    """The data position is step x global_batch_size sequences of this order: another order would
    resume on other sequences."""
    saved = load_config(TINY, small_overrides).to_dict()
    current = load_config(TINY, [*small_overrides, "data.shuffle_seed=3"]).to_dict()
    refusals, _ = compare(saved, current)
    assert any(r.startswith("data.shuffle_seed: -1 -> 3") for r in refusals)
