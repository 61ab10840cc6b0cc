"""Throughput numbers for the metrics log: model TFLOP/s per device, MFU and peak memory.

* Model FLOPs per step come from ``sizing.estimate`` (the dry run's count: 6·T per
  non-embedding, non-norm parameter plus attention 12·T·s·h·hd·L, the Megatron/PaLM MFU
  convention; recompute and SNIP probe passes are *not* counted - this is model, not hardware,
  FLOPs), divided by the world size: every rank does its share of the same step.
* MFU = achieved per-device TFLOP/s / the device's peak (``logging.peak_tflops``, else the dense
  BF16 peak of ``precision/capability.peak_bf16_tflops``; absent when neither is known).
* Peak memory: CUDA ``max_memory_allocated`` of this rank's device, on CPU the process's peak
  RSS (``ru_maxrss``); both since the start of the process, in GiB.
"""

from __future__ import annotations

import dataclasses
import resource

import torch

from megatron_snip.config import Config
from megatron_snip.precision.capability import peak_bf16_tflops
from megatron_snip.sizing import GIB, estimate


def peak_memory_gib(device: torch.device) -> float:
    """The most memory this process has held on ``device`` (CUDA: allocated by tensors; CPU: RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


def peak_memory_text(device: torch.device) -> str:
    """``peak_memory_gib`` for the log line: "1.23 GiB" (CUDA allocated) or "1.23 GiB RSS" (CPU)."""
    return f"{peak_memory_gib(device):.2f} GiB" + ("" if device.type == "cuda" else " RSS")


class Throughput:
    """Turns one step's wall time into the metrics-dict entries ``tflops_per_device``, ``mfu``
    (when a peak is known) and ``peak_memory_gib``.

    Args:
        cfg: the run's config (model shapes, batch, sequence length).
        vocab_size: the padded vocabulary the model was built with.
        world_size: ranks sharing each step's work.
        device: this rank's device (peak lookup and memory).
    """

    def __init__(self, cfg: Config, vocab_size: int, world_size: int, device: torch.device) -> None:
        exact = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
        self.flops_per_device = estimate(exact, world_size).flops_total / world_size
        self.device = device
        self.peak_tflops = cfg.logging.peak_tflops or (
            peak_bf16_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)

    def metrics(self, step_time_s: float) -> dict[str, float]:
        tflops = self.flops_per_device / step_time_s / 1e12
        out = {"tflops_per_device": tflops, "peak_memory_gib": peak_memory_gib(self.device)}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        return out
