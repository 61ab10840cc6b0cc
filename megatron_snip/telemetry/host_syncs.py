"""Count the host syncs that megatron_snip's own code makes (benchmarks, tests).

On a GPU the host waits for the device in three ways, each counted here with its kind:

* ``"read"`` - reading a tensor's value on the host (``.item()``, ``.tolist()``, ``float(t)``,
  ``int(t)``, ``bool(t)``) waits for every kernel queued before it: the stream drains and the GPU
  idles until the host queues more work.
* ``"pageable_copy"`` - a host-to-device copy (``Tensor.to``, ``.cuda``, ``copy_``) from pageable
  memory, or one without ``non_blocking``: the driver stages pageable memory through a pinned
  buffer and the host waits, whatever ``non_blocking`` says; only pinned memory with
  ``non_blocking=True`` returns at once (``data.device_batches`` copies batches that way). A copy
  counts when its source is on the CPU and its target is any other device (on a CPU-only machine
  a test can target ``"meta"``).
* ``"event_sync"`` - ``torch.cuda.Event.synchronize``, ``Stream.synchronize`` and
  ``torch.cuda.synchronize``: the host waits for that point of the stream (``LaggedFlags``' read of
  the step before's event is one: a wait for work long finished, but a wait).

``count_host_syncs`` patches those methods while it is active and counts the calls made from a
frame inside the ``megatron_snip`` package (PyTorch's own reads, e.g. the CPU step counter of a
non-fused AdamW, are not the framework's and touch no device). On CPU the same calls are what
would sync on a GPU, so a CPU test can hold the count to its contract; on a GPU,
``torch.cuda.set_sync_debug_mode("error")`` asserts the same around steady-state steps
(``tests/gpu``, ``scripts/gpu_check.py``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../megatron_snip
_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__")
_MISSING = object()


def _cuda_waits() -> list[tuple[object, str]]:
    """The host waits on the device, looked up when counting starts."""
    return [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]


class HostSyncs:
    """Syncs counted so far: ``count`` and, per sync, ``where`` ("file.py:line" of the caller) and
    ``kinds`` (``"read"``, ``"pageable_copy"`` or ``"event_sync"``, in the same order)."""

    def __init__(self) -> None:
        self.where: list[str] = []
        self.kinds: list[str] = []

    @property
    def count(self) -> int:
        return len(self.where)

    def of(self, kind: str) -> list[str]:
        """``where`` of the syncs of one kind."""
        return [w for w, k in zip(self.where, self.kinds) if k == kind]


def syncing_copy(source: torch.Tensor, target: torch.device | None, non_blocking: bool) -> bool:
    """Whether copying ``source`` to device ``target`` makes the host wait: a host-to-device copy
    (source on the CPU, target another device) unless the source is pinned and ``non_blocking``."""
    if target is None or source.device.type != "cpu" or torch.device(target).type == "cpu":
        return False
    return not (non_blocking and source.is_pinned())


def _to_target(self: torch.Tensor, args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """(target device, non_blocking) of a ``Tensor.to`` call (any of its signatures)."""
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) and device is None:
            device = a
        elif isinstance(a, torch.Tensor) and device is None:
            device = a.device
    non_blocking = bool(kwargs.get("non_blocking", False)) or any(a is True for a in args)
    return (torch.device(device) if device is not None else None), non_blocking


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Within the block, count megatron_snip's host reads of tensor values (see the module doc)."""
    syncs = HostSyncs()

    def note(kind: str) -> None:
        caller = sys._getframe(2)
        if caller.f_code.co_filename.startswith(_PACKAGE) and caller.f_code.co_filename != __file__:
            syncs.where.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            syncs.kinds.append(kind)

    def counted(original):
        def read(self, *args, **kwargs):
            note("read")
            return original(self, *args, **kwargs)
        return read

    def counted_to(original):
        def to(self, *args, **kwargs):
            if syncing_copy(self, *_to_target(self, args, kwargs)):
                note("pageable_copy")
            return original(self, *args, **kwargs)
        return to

    def counted_cuda(original):
        def cuda(self, device=None, non_blocking=False, **kwargs):
            if syncing_copy(self, torch.device("cuda"), non_blocking):
                note("pageable_copy")
            return original(self, device, non_blocking, **kwargs)
        return cuda

    def counted_copy(original):
        def copy_(self, src, non_blocking=False):
            if syncing_copy(src, self.device, non_blocking):
                note("pageable_copy")
            return original(self, src, non_blocking)
        return copy_

    def counted_wait(original):
        def wait(*args, **kwargs):
            note("event_sync")
            return original(*args, **kwargs)
        return wait

    patches = [(torch.Tensor, name, counted) for name in _METHODS]
    patches += [(torch.Tensor, "to", counted_to), (torch.Tensor, "cuda", counted_cuda),
                (torch.Tensor, "copy_", counted_copy)]
    patches += [(owner, name, counted_wait) for owner, name in _cuda_waits()]
    # What each owner itself held (a class may inherit the method: then the patch is removed, not set back).
    originals = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in patches]
    for owner, name, wrap in patches:
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield syncs
    finally:
        for owner, name, original in originals:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
