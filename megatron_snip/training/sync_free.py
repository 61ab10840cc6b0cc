"""Steady-state training steps held to "no host sync", on CUDA by PyTorch itself.

``steady_steps(trainer, first, count)`` runs ``trainer.train_step`` for ``count`` steps from
``first`` inside ``telemetry.host_syncs.count_host_syncs`` and, on CUDA, inside
``torch.cuda.set_sync_debug_mode("error")``: any synchronizing CUDA call (a device read, a
pageable or blocking host-to-device copy, a stream synchronize) then raises where it is made.
PyTorch's mode does not see a ``non_blocking`` copy from pageable memory (the driver stages it
through a pinned buffer and the host waits); the counter does, so both are asserted. Used by
``scripts/gpu_check.py`` (``check_sync_free``), ``tests/gpu/test_sync_free_steps.py`` and, on
CPU, ``tests/unit/test_device_batches.py`` (where the foreach AdamW's skip flag is the one read a
step makes by design).

Run it after warm-up steps: the first steps allocate (cudaMalloc of the caching allocators, the
pinned host pool), and an allocation may synchronize.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_snip.telemetry.host_syncs import HostSyncs, count_host_syncs


@contextlib.contextmanager
def sync_debug_error(device: torch.device) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` within the block on CUDA (restored after); nothing elsewhere."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def steady_steps(trainer, first: int, count: int) -> HostSyncs:
    """Steps ``first .. first + count - 1`` of ``trainer`` (a ``training.trainer.Trainer``), with
    the host syncs its code made (see the module doc); raises on CUDA at the first synchronizing call."""
    with count_host_syncs() as syncs, sync_debug_error(trainer.device):
        for step in range(first, first + count):
            trainer.train_step(step)
    return syncs


__all__ = ["steady_steps", "sync_debug_error"]
