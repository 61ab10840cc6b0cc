"""Count the host reads of tensor values that megatron_snip's own code makes (benchmarks, tests).

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``float(t)``,
``int(t)``, ``bool(t)``) waits for every kernel queued before it: the stream drains and the GPU
idles until the host queues more work. ``count_host_syncs`` patches those five methods of
``torch.Tensor`` while it is active and counts the calls made from a frame inside the
``megatron_snip`` package (PyTorch's own reads, e.g. the CPU step counter of a non-fused AdamW,
are not the framework's and touch no device). On CPU the same calls are what would sync on a
GPU, so a CPU test can hold the count to its contract.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../megatron_snip
_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__")


class HostSyncs:
    """Reads counted so far: ``count`` and, per read, ``where`` ("file.py:line" of the caller)."""

    def __init__(self) -> None:
        self.where: list[str] = []

    @property
    def count(self) -> int:
        return len(self.where)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Within the block, count megatron_snip's host reads of tensor values (see the module doc)."""
    syncs = HostSyncs()
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def counted(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(_PACKAGE) and caller.f_code.co_filename != __file__:
                syncs.where.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(self, *args, **kwargs)

        return read

    for name in _METHODS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield syncs
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
