"""Steady-state training steps make no host sync on CUDA (issue #34 item 4); skipped without CUDA.

``training/sync_free.steady_steps`` runs them under ``torch.cuda.set_sync_debug_mode("error")``
(a synchronizing CUDA call raises) and the framework's counter (which also sees pageable
host-to-device copies, invisible to PyTorch's mode). The batch arrives pinned and non-blocking,
prefetched a step ahead (``data/device_batches.py``); torch's fused AdamW takes the skip flag as
``found_inf``. The CPU model of the same contract: tests/unit/test_device_batches.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.training.sync_free import steady_steps
from megatron_snip.training.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("backend, plan", [("emulated", "bf16"), ("torch", "uniform:fp8")])
def test_steady_state_steps_make_no_host_sync(tmp_path, backend, plan):
    cfg = load_config("launch/configs/tiny.toml", [
        "training.device=cuda", f"precision.backend={backend}", f"precision.initial_plan={plan}",
        "snip.enabled=false", "training.max_steps=8", "training.progress=false", "data.valid_paths=[]",
        f"training.run_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"])
    tr = Trainer(cfg)
    assert tr.batches.pinned and tr.batches.needs_tokens
    for step in range(2):  # warm-up: the caching allocators' first allocations may synchronize
        tr.train_step(step)
    syncs = steady_steps(tr, 2, 4)  # raises at the first synchronizing CUDA call
    assert syncs.count == 0, list(zip(syncs.kinds, syncs.where))
