"""SNIP's statistics read the device a handful of times per re-plan, not once per value.

``snip/device_sums.DeviceSums`` keeps every contribution on the device and reads them in one
``tolist``; these tests hold the collector to a fixed number of reads whatever the model size,
and the deferred arithmetic to the per-value reads' bits (same values, same order of Python
additions), which is why the plans cannot change.
"""

from __future__ import annotations

import torch

from megatron_snip.snip.device_sums import DeviceSums
from megatron_snip.snip.stats import ProbeConfig, StatsCollector
from megatron_snip.telemetry.host_syncs import count_host_syncs


def test_device_sums_are_the_float_reads_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(50, generator=gen).pow(3).sum() for _ in range(40)]  # fp32 0-d, mixed signs
    by_reads = {"a": 0.0, "b": 0.0, "c": 0, "d": 0.0}
    for i, v in enumerate(values):
        by_reads["a"] += float(v)
        by_reads["b"] += abs(float(v))
        by_reads["c"] += float(v)  # an int start, as Python's sum()
        by_reads["d"] = float(v) * 7 * 3
    target = {"a": 0.0, "b": 0.0, "c": 0, "d": 0.0}
    pending = DeviceSums()
    for v in values:
        pending.add(target, "a", v)
        pending.add_abs(target, "b", v)
        pending.add(target, "c", v)
        pending.set(target, "d", v, then=lambda x: x * 7 * 3)
    assert target == {"a": 0.0, "b": 0.0, "c": 0, "d": 0.0}  # nothing applied before the read
    with count_host_syncs() as syncs:
        pending.settle()
    assert syncs.count == 1 and len(pending) == 0
    assert target == by_reads  # exact float equality


def _collect_reads(small_overrides, layers: int, run_dir) -> tuple[int, list[str]]:
    from megatron_snip.config import load_config
    from megatron_snip.training.trainer import Trainer

    tr = Trainer(load_config("launch/configs/tiny.toml", small_overrides + [
        f"model.num_layers={layers}", f"training.run_dir={run_dir}"]))
    for step in range(2):  # AdamW state exists: the preconditioner reads its step counts
        tr.train_step(step)
    probes = tr.micro_batches(5)
    collector = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, curvature_noise="error"))
    with count_host_syncs() as syncs:
        collector.collect(tr, probes, step=5)
    return syncs.count, syncs.where


def test_a_collect_reads_the_device_a_fixed_number_of_times(small_overrides, tmp_path):
    """Reads: AdamW's step counts (one), pass 1's sums (one), the error-direction noise's signs
    (one per probe batch and draw), passes 2-3's sums (one) - the same for 1 and 2 blocks; the
    per-value reads were ~20 per linear, format and probe batch."""
    one, where_one = _collect_reads(small_overrides, 1, tmp_path / "one")
    two, where_two = _collect_reads(small_overrides, 2, tmp_path / "two")
    assert one == two, (where_one, where_two)
    assert one <= 3 + 2, where_one  # 2 probe micro-batches x 1 draw of signs
