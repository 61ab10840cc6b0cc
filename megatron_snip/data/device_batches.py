"""Token batches from the host to the device without a stream sync, one step ahead.

A copy from pageable host memory is synchronous on CUDA whatever ``non_blocking`` says (the
driver stages it through a pinned buffer and the host waits), so a step that copies its batch
that way drains the stream once per step and cancels the lagged-flag design
(``training/step_guard.py``). Here a CPU batch (B, S+1) int64 is pinned (``Tensor.pin_memory``:
a host-side copy into page-locked memory) and copied with ``non_blocking=True`` on a side stream;
the consumer's stream waits on the copy's event (a device-side wait) and the device tensor is
marked used there (``record_stream``), so the caching allocator does not hand its memory to the
side stream while the step still reads it. The pinned host block may be dropped at once: PyTorch's
caching host allocator records an event for a pinned block used in an asynchronous copy and
reuses the block only after it (``at::cuda::CachingHostAllocator``).

A middle pipeline stage reads no tokens (its input is the previous stage's activation; the
labels are the last stage's): ``BatchLoader(needs_tokens=False)`` returns the CPU batch itself,
of which the stage reads only the shape. On any other device than CUDA the copy is ``Tensor.to``
(a no-op on CPU).

``BatchLoader.take(key, fetch)`` returns the batch prefetched under ``key`` if there is one, else
copies ``fetch()`` now; ``prefetch(key, fetch)`` starts the copy of the batch a later ``take``
will want (the trainer: step ``s + 1``'s batch, issued as step ``s`` starts, so it overlaps step
``s``'s kernels). ``ahead(batches)`` yields each batch of an iterable on the device with the
next one's copy already started (evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch


class _CudaApi:
    """The torch.cuda calls the CUDA copy makes (a seam: a CPU test passes a recording stand-in)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    def copy_stream(self) -> Any:
        if self._stream is None:  # created on first use: building a loader touches no CUDA state
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def stream(self, s: Any) -> Any:
        return torch.cuda.stream(s)

    def event(self) -> Any:
        return torch.cuda.Event()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def record_stream(self, t: torch.Tensor, s: Any) -> None:
        t.record_stream(s)


class _Pending:
    """A device batch whose copy was issued on the side stream, with the event after it."""

    def __init__(self, tensor: torch.Tensor, event: Any) -> None:
        self.tensor, self.event = tensor, event


class BatchLoader:
    """Copies CPU token batches (B, S+1) int64 to ``device`` for one pipeline stage (see the module doc).

    Args:
        device: the stage's device.
        needs_tokens: False on a middle pipeline stage (neither first nor last): batches stay on
            the host, untouched.
        cuda_api: the torch.cuda calls (tests only); default the real ones when ``device`` is CUDA.
    """

    def __init__(self, device: torch.device, needs_tokens: bool = True, cuda_api: Any = None) -> None:
        self.device = torch.device(device)
        self.needs_tokens = needs_tokens
        self._cuda = cuda_api if cuda_api is not None else (
            _CudaApi(self.device) if self.device.type == "cuda" else None)
        self._ahead: tuple[Hashable, Any] | None = None  # (key, pending copy) of the prefetched batch

    @property
    def pinned(self) -> bool:
        """Whether copies go through pinned memory and a side stream (CUDA)."""
        return self._cuda is not None

    def _start(self, batch: torch.Tensor) -> Any:
        """Issue the copy of ``batch`` (CPU); returns what ``_finish`` turns into the device tensor."""
        if not self.needs_tokens:
            return batch
        if self._cuda is None:
            return batch.to(self.device)
        pinned = self._cuda.pin(batch)
        with self._cuda.stream(self._cuda.copy_stream()):
            out = pinned.to(self.device, non_blocking=True)
            done = self._cuda.event()
            done.record(self._cuda.copy_stream())
        return _Pending(out, done)

    def _finish(self, started: Any) -> torch.Tensor:
        """The device tensor of a started copy, safe to read on the current stream."""
        if not isinstance(started, _Pending):
            return started
        current = self._cuda.current_stream()
        current.wait_event(started.event)  # a device-side wait: the host does not block
        self._cuda.record_stream(started.tensor, current)  # its memory is in use on the current stream until then
        return started.tensor

    def load(self, batch: torch.Tensor) -> torch.Tensor:
        """``batch`` (CPU) where this stage reads it, now."""
        return self._finish(self._start(batch))

    def prefetch(self, key: Hashable, fetch: Callable[[], torch.Tensor]) -> None:
        """Start copying ``fetch()`` for a later ``take(key, ...)`` (replaces an unclaimed prefetch)."""
        self._ahead = (key, self._start(fetch()))

    def take(self, key: Hashable, fetch: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The batch prefetched under ``key``, or ``fetch()`` copied now (a stale prefetch is dropped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            return self._finish(ahead[1])
        return self.load(fetch())

    def ahead(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Each of ``batches`` (CPU) on the device, the next one's copy started before it is yielded."""
        it = iter(batches)
        try:
            started = self._start(next(it))
        except StopIteration:
            return
        for batch in it:
            following = self._start(batch)
            yield self._finish(started)
            started = following
        yield self._finish(started)
