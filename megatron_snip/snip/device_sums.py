"""SNIP's additive statistics kept on the device and read on the host in one transfer.

Reading a statistic with ``float(tensor)`` waits for the stream each time; pass 1 of
``snip/stats.py`` made about 20 such reads per linear, format and probe batch. ``DeviceSums``
instead records each contribution as a 0-d tensor with where it goes (a dict and key) and how it
combines (added, added as |value|, set, set through a host function), and ``settle`` reads all of them with
one ``torch.stack(...).tolist()`` and applies them in the order they were recorded.

The host arithmetic is the one the float reads did: each 0-d value (fp32, or fp64) is widened to
fp64 on the device (exact), read, and combined in Python floats in the same order, so the
statistics - and the plans solved from them - are bit for bit those of the per-value reads.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch

Combine = Callable[[float, float], float]


def _add(old: float, v: float) -> float:
    return old + v


def _add_abs(old: float, v: float) -> float:
    return old + abs(v)


def _set(old: float, v: float) -> float:
    return v


class DeviceSums:
    """Contributions to host dicts of floats, pending on the device until ``settle`` (one read)."""

    def __init__(self) -> None:
        self._pending: list[tuple[MutableMapping[str, Any], str, torch.Tensor, Combine]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, target: MutableMapping[str, Any], key: str, value: torch.Tensor) -> None:
        """``target[key] += float(value)`` at the next ``settle``."""
        self._pending.append((target, key, value, _add))

    def add_abs(self, target: MutableMapping[str, Any], key: str, value: torch.Tensor) -> None:
        """``target[key] += abs(float(value))`` at the next ``settle``."""
        self._pending.append((target, key, value, _add_abs))

    def set(self, target: MutableMapping[str, Any], key: str, value: torch.Tensor,
            then: Callable[[float], float] | None = None) -> None:
        """``target[key] = float(value)`` (passed through ``then`` on the host: the same float
        arithmetic as on a read value) at the next ``settle``."""
        combine = _set if then is None else (lambda old, v: then(v))
        self._pending.append((target, key, value, combine))

    def settle(self) -> None:
        """Read every pending value (one ``tolist`` of their stack) and apply them in order."""
        if not self._pending:
            return
        values = torch.stack([t.detach().reshape(()).to(torch.float64) for _, _, t, _ in self._pending]).tolist()
        for (target, key, _, combine), v in zip(self._pending, values):
            target[key] = combine(target[key], v)
        self._pending = []
