"""Asynchronous checkpoints (``training.async_save``): the write and sha256 of a shard run in a
background thread while training continues, as torchtitan's ``async_mode`` and Megatron's
``--async-save`` do.

One save, in four parts:

1. **Snapshot** (main thread, at the save step): ``Trainer.state_dict`` - model, optimizer, plan,
   RNG streams, data position, callbacks' state - is copied into host buffers that this module
   keeps for the run and reuses (pinned on CUDA, so the device-to-host copies are ``non_blocking``
   on the current stream, ordered before the next step's updates; an event marks their end).
   Only the ranks that write a shard (DP rank 0 of each (TP, PP) shard) copy anything.
2. **Write** (writer thread): wait for that event, then ``RunDirectory.write_shard`` - the same
   ``checkpoint.write_shard`` as the synchronous save: ``.partial`` file, fsync, sha256, rename,
   sidecar, all inside ``.tmp_step_<N>/``. The thread runs no collective: a second thread issuing
   NCCL or gloo collectives would race the training stream's.
3. **Agree** (main thread): at the next log, eval or save step (where the trainer reads its step
   outcomes anyway) every rank all-reduces two flags over the world group - "my writer is still
   busy", "my writer failed" - so all ranks take the same decision at the same step. One process
   needs no collective and checks at every step.
4. **Commit** (main thread, rank 0): once no writer is busy, ``checkpoint.commit`` - the same
   atomic rename of the temp dir with ``meta.json`` (the shards' sha256) as the synchronous save.
   Until then the checkpoint is invisible: a kill leaves the previous committed one as the newest,
   and ``training.resume=auto`` continues from it bit-exactly (tests/unit/test_async_checkpoint.py).

At most one save is in flight: the next one (and the final and preemption saves, which are
synchronous) first waits for the previous write and commits it. A writer's error is raised in the
training loop at the next agreement, naming the checkpoint, on every rank.

The host buffers hold one copy of this rank's shard for the run (12 B per parameter of the shard,
fp32 weights and AdamW moments, plus the RNG and plan), the memory torchtitan's pinned mode keeps too.

Test hook: ``MEGATRON_SNIP_ASYNC_SAVE_HOOK="<point>:<action>[:<step>]"`` makes the writer of
checkpoint ``<step>`` (any step without it) stop at ``<point>`` - ``start`` (snapshot taken, nothing
written), ``partial`` (the shard's ``.partial`` file written and fsynced, not renamed), ``written``
(shard and sidecar in the temp dir, not committed) - and ``pause`` there (it prints
``async-save hook: paused at <point> of step <N>`` on stdout and sleeps, for a test to kill the
process) or ``fail`` (raise, as a full disk would).
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_snip.parallel import comm
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.run_dir import RunDirectory

HOOK_ENV = "MEGATRON_SNIP_ASYNC_SAVE_HOOK"
HOOK_POINTS = ("start", "partial", "written")
Hook = Callable[[str, int], None]


def hook_from_env(environ: dict[str, str] | None = None) -> Hook | None:
    """The writer's test hook from ``$MEGATRON_SNIP_ASYNC_SAVE_HOOK`` (module docstring); None if unset."""
    spec = (os.environ if environ is None else environ).get(HOOK_ENV, "")
    if not spec:
        return None
    parts = spec.split(":")
    ok = (len(parts) in (2, 3) and parts[0] in HOOK_POINTS and parts[1] in ("pause", "fail")
          and (len(parts) == 2 or parts[2].isdigit()))
    if not ok:
        raise ValueError(f"${HOOK_ENV}={spec!r} is not <point>:<action>[:<step>] with point one of {HOOK_POINTS} "
                         f"and action pause or fail (e.g. partial:pause:4); unset it outside tests")
    point, action = parts[0], parts[1]
    only = int(parts[2]) if len(parts) == 3 else None

    def hook(where: str, step: int) -> None:
        if where != point or (only is not None and step != only):
            return
        if action == "fail":
            raise OSError(f"{HOOK_ENV} failed the writer at {where} of step {step}")
        print(f"async-save hook: paused at {where} of step {step}", flush=True)
        while True:  # until the test kills the process
            time.sleep(3600)

    return hook


class HostBuffers:
    """Host copies of a nested state (dicts, lists, tuples of tensors and plain values), reused
    from one save to the next while the structure's tensor shapes and dtypes stay the same.

    ``pin``: the buffers are pinned and device tensors copied ``non_blocking`` (CUDA); the caller
    records an event after ``copy`` and the reader waits for it. Plain values are deep-copied."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def copy(self, state: Any) -> Any:
        self._next = 0
        return self._copy(state)

    def _buffer_like(self, t: torch.Tensor) -> torch.Tensor:
        i = self._next
        self._next += 1
        if i < len(self._buffers) and self._buffers[i].shape == t.shape and self._buffers[i].dtype == t.dtype:
            return self._buffers[i]
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            return self._buffer_like(src).copy_(src, non_blocking=self.pin and src.device.type == "cuda")
        if isinstance(obj, dict):
            out = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self._copy(v)
            if hasattr(obj, "_metadata"):  # a module state_dict's version records (load_state_dict reads them)
                out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(obj, list):
            return [self._copy(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._copy(v) for v in obj)
        return copy.deepcopy(obj)


@dataclass
class _InFlight:
    step: int
    state: dict[str, Any] | None  # host copy (None on ranks that write no shard)
    layer_ids: list[int]
    meta: dict[str, Any] | None  # rank 0's meta.json
    ready: Any  # torch.cuda.Event after the device-to-host copies, or None
    started_s: float = field(default_factory=time.perf_counter)
    written_s: float | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None


class AsyncCheckpointer:
    """Saves ``RunDirectory`` checkpoints in the background, one in flight at most (module docstring).

    Called on every rank of the world group, from the main thread only: ``start`` at a save
    step, ``poll`` after every step, ``finish`` before a synchronous save and at the end."""

    def __init__(self, run_directory: RunDirectory, device: torch.device, log: Callable[[str], None],
                 hook: Hook | None = None) -> None:
        self.run_directory = run_directory
        self.topo = run_directory.topo
        self.cuda = device.type == "cuda"
        self.log = log
        self.hook = hook
        self.buffers = HostBuffers(pin=self.cuda)
        self._pending: _InFlight | None = None

    @staticmethod
    @contextlib.contextmanager
    def on_exit(saver: AsyncCheckpointer | None) -> Iterator[None]:
        """Around a training loop: on an error, ``abandon`` the in-flight save (its writer is
        waited for, never left writing as the process ends); on a normal exit ``finish`` it."""
        try:
            yield
        except BaseException:
            if saver is not None:
                saver.abandon()
            raise
        if saver is not None:
            saver.finish()

    @property
    def in_flight(self) -> int | None:
        """The step of the checkpoint being written or awaiting its commit; None when none is."""
        return self._pending.step if self._pending is not None else None

    def start(self, step: int, state: dict[str, Any], layer_ids: list[int], meta: dict[str, Any] | None) -> None:
        """Snapshot ``state`` (this rank's ``Trainer.state_dict()``) and hand it to a writer thread;
        returns once the snapshot is taken (on CUDA: queued). The previous save is committed first."""
        self.finish()
        host = self.buffers.copy(state) if self.run_directory.writes_shard else None
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        p = _InFlight(step, host, list(layer_ids), meta, ready)
        p.thread = threading.Thread(target=self._write, args=(p,), name=f"checkpoint-writer-{step}", daemon=True)
        self._pending = p
        p.thread.start()

    def _write(self, p: _InFlight) -> None:
        """The writer thread: no collective, no device work but the wait for the snapshot's copies."""
        try:
            if p.ready is not None:
                p.ready.synchronize()
            self._hook("start", p.step)
            if p.state is not None:
                self.run_directory.write_shard(p.step, p.state, p.layer_ids,
                                               on_partial=lambda: self._hook("partial", p.step))
            self._hook("written", p.step)
        except BaseException as e:  # noqa: BLE001 - every failure is raised in the training loop (_settle)
            p.error = e
        p.written_s = time.perf_counter()

    def _hook(self, point: str, step: int) -> None:
        if self.hook is not None:
            self.hook(point, step)

    def poll(self, read_step: bool) -> None:
        """After a step: commit the in-flight checkpoint if every rank's writer is done, raise if one
        failed, else return at once. ``read_step``: a log/eval/save step (the same on every rank);
        a distributed run agrees only there, one process at every step."""
        if self._pending is not None and (read_step or not self.topo.is_distributed):
            self._settle(block=False)

    def finish(self) -> None:
        """Wait for the in-flight save's writers on every rank and commit it (every rank returns
        after the commit, as from the synchronous save); nothing to do when none is in flight."""
        if self._pending is not None:
            self._settle(block=True)

    def abandon(self) -> None:
        """On the way out of a failed run: wait for this rank's writer; commit only in one process
        (a distributed commit needs every rank's agreement, which a failing run cannot promise -
        the temp dir stays, and the newest committed checkpoint is the one before)."""
        p = self._pending
        if p is None:
            return
        if not self.topo.is_distributed:
            try:
                self._settle(block=True)
            except Exception as e:  # noqa: BLE001 - the run's own error is the one to raise
                self.log(f"async checkpoint step {p.step}: {e}")
            return
        assert p.thread is not None
        p.thread.join()
        self._pending = None
        self.log(f"async checkpoint {ckpt.tmp_dir(self.run_directory.ckpt_root, p.step)} left uncommitted: the run "
                 f"stopped on an error before every rank's writer agreed")

    def _settle(self, block: bool) -> None:
        p = self._pending
        assert p is not None and p.thread is not None
        if block:
            p.thread.join()
        busy = p.thread.is_alive()
        failed = not busy and p.error is not None
        if self.topo.is_distributed:
            group = self.topo.world_group
            flags = torch.tensor([float(busy), float(failed)], device=comm.group_device(group))
            busy_ranks, failed_ranks = (int(v) for v in comm.all_reduce_sum(flags, group).tolist())
        else:
            busy_ranks, failed_ranks = int(busy), int(failed)
        where = ckpt.tmp_dir(self.run_directory.ckpt_root, p.step)
        if failed_ranks:
            self._pending = None
            if failed:
                err = p.error
                raise ckpt.CheckpointError(
                    f"async checkpoint of step {p.step} ({where}) failed on rank {self.topo.rank}: "
                    f"{type(err).__name__}: {err}; it was not committed (the newest committed checkpoint is still "
                    f"the one before; training.async_save=false writes in the training loop)") from err
            raise ckpt.CheckpointError(
                f"async checkpoint of step {p.step} ({where}) failed on {failed_ranks} other rank(s) (their logs "
                f"name the error); it was not committed")
        if busy_ranks:
            assert not block, "a joined writer cannot be busy"
            return
        self.run_directory.commit(p.step, p.meta)
        if block and self.topo.is_distributed:
            comm.barrier(self.topo.world_group)  # nobody reads or re-saves before the commit is done
        self._pending = None
        write_s = (p.written_s or time.perf_counter()) - p.started_s
        self.log(f"checkpoint {ckpt.step_dir(self.run_directory.ckpt_root, p.step)} committed (async: written in "
                 f"{write_s:.2f} s in the background)")
