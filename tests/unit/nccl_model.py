"""A CPU model of NCCL's point-to-point semantics, so the pipeline schedules can run under them.

    world = RendezvousWorld(size=4)                   # ranks are threads of this process
    monkeypatch.setattr(comm, "dist", world)          # parallel/comm's torch.distributed
    results = world.run(fn)                           # fn(rank, world.group) on one thread per rank

gloo buffers a send, so every CPU test passes whatever order a schedule posts its ops in. NCCL
does not (for messages past its small eager threshold); this model keeps what matters of it:

* a send completes only once the peer has posted the matching receive (rendezvous);
* a rank's ops run in posting order per stream: plain ``isend``/``irecv`` on the stream of the
  pair (torch gives each pair its own two-rank communicator), each op one call; a
  ``batch_isend_irecv`` is ONE call (ncclGroupStart/End) on the group's stream, whose ops
  progress together; a call starts only when the previous call on its stream has completed;
* the k-th send from A to B matches the k-th receive on B from A of the same communicator; both
  must have the same dtype and element count;
* a collective (``broadcast``, the schedules' last call) is a rendezvous of every rank of the group,
  on the group's stream;
* every tensor handed to an op lives on the group's device (NCCL refuses anything else).

``buffered=True`` gives gloo's behaviour instead (a send completes at once): the reference.
Deadlock is detected exactly - every live rank waits and no posted op can progress (progress is
run to a fixed point on every post) - and raised as ``Deadlock`` in each waiting rank; a
wall-clock limit is only the backstop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class Deadlock(RuntimeError):
    """Every live rank waits on an op that no posted op can complete."""


@dataclass(frozen=True, eq=False)
class FakeGroup:
    """A process group of ``ranks`` (global ranks) whose collectives run on ``bound_device_id``."""

    ranks: tuple[int, ...]
    bound_device_id: torch.device


@dataclass(eq=False)
class _Op:
    kind: str  # "send" | "recv"
    rank: int  # the rank that posted it
    peer: int  # global rank of the other side
    tensor: torch.Tensor
    done: bool = False


@dataclass(eq=False)
class _Call:
    """One call on a stream: a single op, a batch, or one rank's part of a collective."""

    ops: list[_Op] = field(default_factory=list)
    collective: Any = None  # the _Collective this call takes part in

    @property
    def done(self) -> bool:
        return self.collective.done if self.collective is not None else all(op.done for op in self.ops)


@dataclass(eq=False)
class _Collective:
    group: FakeGroup
    apply: Callable[[dict[int, torch.Tensor]], None]
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    done: bool = False


@dataclass(eq=False)
class P2POp:
    op: Callable[..., Any]
    tensor: torch.Tensor
    peer: int
    group: FakeGroup


class Work:
    def __init__(self, world: RendezvousWorld, call: _Call) -> None:
        self._world, self._call = world, call

    def wait(self) -> bool:
        self._world._wait(lambda: self._call.done)
        return True


class RendezvousWorld:
    """The ``torch.distributed`` functions ``parallel/comm.py`` uses, over ``size`` thread-ranks
    sharing one group (``self.group``, all ranks); see the module docstring for the semantics."""

    def __init__(self, size: int, *, buffered: bool = False, device: str = "cpu", limit_s: float = 120.0) -> None:
        self.size, self.buffered, self.limit_s = size, buffered, limit_s
        self.group = FakeGroup(tuple(range(size)), torch.device(device))
        self._cv = threading.Condition()
        self._local = threading.local()
        self._streams: dict[tuple[int, Any], deque[_Call]] = {}
        self._mailbox: dict[tuple[Any, int, int], deque[torch.Tensor]] = {}  # buffered sends
        self._collectives: dict[tuple[int, int], _Collective] = {}  # (group id, sequence number)
        self._seq: dict[tuple[int, int], int] = {}  # (rank, group id) -> collectives posted
        self._live = 0
        self._waiting: dict[int, Callable[[], bool]] = {}  # rank -> what it waits for
        self._stuck: str | None = None
        self._error: BaseException | None = None

    # --- the torch.distributed surface -----------------------------------------------------------
    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group: FakeGroup) -> int:
        return len(group.ranks)

    def get_rank(self, group: FakeGroup) -> int:
        return group.ranks.index(self._local.rank)

    def get_backend(self, group: FakeGroup) -> str:
        return "nccl"

    def isend(self, tensor: torch.Tensor, dst: int, group: FakeGroup, tag: int = 0) -> Work:
        return self._post(("pair", *sorted((self._local.rank, dst))), [self._op("send", tensor, dst, group)])

    def irecv(self, tensor: torch.Tensor, src: int, group: FakeGroup, tag: int = 0) -> Work:
        return self._post(("pair", *sorted((self._local.rank, src))), [self._op("recv", tensor, src, group)])

    P2POp = P2POp

    def batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        assert ops and all(o.op in (self.isend, self.irecv) for o in ops), "batch_isend_irecv takes isend/irecv P2POps"
        group = ops[0].group
        work = self._post(("group", id(group)), [self._op("send" if o.op == self.isend else "recv", o.tensor, o.peer,
                                                          group) for o in ops])
        return [work] * len(ops)

    def broadcast(self, tensor: torch.Tensor, src: int, group: FakeGroup) -> None:
        def apply(ts: dict[int, torch.Tensor]) -> None:
            for t in ts.values():
                t.copy_(ts[src])
        self._collective(tensor, group, apply)

    # --- running ranks -------------------------------------------------------------------------
    def run(self, fn: Callable[[int, FakeGroup], Any]) -> list[Any]:
        """``fn(rank, self.group)`` on one thread per rank; results by rank. Raises the first
        rank's error (a ``Deadlock`` only when no rank failed otherwise)."""
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException] = {}
        self._live = self.size

        def body(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank, self.group)
            except BaseException as e:  # noqa: BLE001 - reported to the caller below
                errors[rank] = e
            finally:
                with self._cv:
                    self._live -= 1
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.limit_s + 10)
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"ranks still running after {self.limit_s + 10:.0f} s")
        if errors:
            real = [e for e in errors.values() if not isinstance(e, Deadlock)]
            raise (real or list(errors.values()))[0]
        return results

    # --- the engine ----------------------------------------------------------------------------
    @staticmethod
    def _check_device(tensor: torch.Tensor, group: FakeGroup) -> torch.Tensor:
        if tensor.device != group.bound_device_id:
            raise RuntimeError(f"NCCL model: a tensor on {tensor.device}, the group runs on {group.bound_device_id}")
        return tensor

    def _op(self, kind: str, tensor: torch.Tensor, peer: int, group: FakeGroup) -> _Op:
        return _Op(kind, self._local.rank, peer, self._check_device(tensor, group))

    def _post(self, stream: Any, ops: list[_Op], collective: _Collective | None = None) -> Work:
        call = _Call(ops, collective)
        with self._cv:
            self._streams.setdefault((self._local.rank, stream), deque()).append(call)
            self._progress()
        return Work(self, call)

    def _collective(self, tensor: torch.Tensor, group: FakeGroup, apply: Callable) -> None:
        self._check_device(tensor, group)
        rank = self._local.rank
        with self._cv:
            seq = self._seq.get((rank, id(group)), 0)
            self._seq[(rank, id(group))] = seq + 1
            coll = self._collectives.setdefault((id(group), seq), _Collective(group, apply))
            coll.tensors[rank] = tensor
        self._post(("group", id(group)), [], coll).wait()

    def _head(self, rank: int, stream: Any) -> _Call | None:
        q = self._streams.get((rank, stream))
        return q[0] if q else None

    def _progress(self) -> None:
        """Match and complete ops until nothing changes (caller holds the lock)."""
        changed = True
        while changed:
            changed = False
            for (rank, stream), q in list(self._streams.items()):
                if not q:
                    continue
                call = q[0]
                if call.collective is not None:
                    changed |= self._try_collective(call.collective)
                for op in call.ops:
                    if not op.done and self._first_pending(call, op):
                        changed |= self._try_match(stream, op)
                if call.done:
                    q.popleft()
                    changed = True
        self._cv.notify_all()

    @staticmethod
    def _first_pending(call: _Call, op: _Op) -> bool:
        """Whether ``op`` is its call's first unfinished op of its kind towards its peer (FIFO per direction)."""
        return next(o for o in call.ops if not o.done and o.kind == op.kind and o.peer == op.peer) is op

    def _try_match(self, stream: Any, op: _Op) -> bool:
        box = self._mailbox.setdefault((stream, *((op.rank, op.peer) if op.kind == "send" else (op.peer, op.rank))),
                                       deque())
        if self.buffered:
            if op.kind == "send":
                box.append(op.tensor.clone())
                op.done = True
                return True
            if box:
                self._copy(box.popleft(), op)
                return True
            return False
        if op.kind != "send":
            return False  # matched from the sender's side
        peer_call = self._head(op.peer, stream)
        if peer_call is None:
            return False
        recv = next((o for o in peer_call.ops if not o.done and o.kind == "recv" and o.peer == op.rank), None)
        if recv is None:
            return False
        self._copy(op.tensor, recv)
        op.done = True
        return True

    @staticmethod
    def _copy(src: torch.Tensor, recv: _Op) -> None:
        if src.dtype != recv.tensor.dtype or src.numel() != recv.tensor.numel():
            raise RuntimeError(f"NCCL model: rank {recv.peer} sent {src.dtype} x {src.numel()}, rank {recv.rank} "
                               f"receives {recv.tensor.dtype} x {recv.tensor.numel()}")
        recv.tensor.copy_(src.view_as(recv.tensor))
        recv.done = True

    def _try_collective(self, coll: _Collective) -> bool:
        if coll.done or len(coll.tensors) < len(coll.group.ranks):
            return False
        if not all((h := self._head(r, ("group", id(coll.group)))) is not None and h.collective is coll
                   for r in coll.group.ranks):
            return False  # some rank has not reached it on its stream yet
        coll.apply(coll.tensors)
        coll.done = True
        return True

    def _wait(self, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.limit_s
        rank = self._local.rank
        with self._cv:
            while not ready():
                if self._stuck is not None:
                    raise Deadlock(self._stuck)
                self._waiting[rank] = ready
                try:
                    # A notified waiter still counts as waiting until it wakes: look at what each waits for.
                    if len(self._waiting) == self._live and not any(r() for r in self._waiting.values()):
                        self._stuck = "every rank waits and no posted op can progress: " + self._describe()
                        self._cv.notify_all()
                        raise Deadlock(self._stuck)
                    if not self._cv.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                        raise TimeoutError(f"NCCL model: rank {rank} waited {self.limit_s:.0f} s")
                finally:
                    del self._waiting[rank]

    def _describe(self) -> str:
        heads = []
        for (rank, stream), q in sorted(self._streams.items(), key=lambda kv: kv[0][0]):
            if q:
                pending = [o for o in q[0].ops if not o.done]
                ops = ", ".join(f"{o.kind} {'to' if o.kind == 'send' else 'from'} {o.peer}" for o in pending)
                heads.append(f"rank {rank} on {stream[0]} stream: {ops or 'collective'}")
        return "; ".join(heads)
