"""Where a faster path fell back to a slower one with the same numerics, and why - recorded once.

Quantizer compilation, the Triton kernels and the torch backend's scaled-mm GEMMs each fall
back (to eager quantizers, to the PyTorch quantizers, to the emulated GEMM) rather than stop
a run; never silently: ``record`` warns once per key (RuntimeWarning, on every rank) and
queues a line that the trainer writes to the run's text log (``drain``).
"""

from __future__ import annotations

import warnings

__all__ = ["drain", "record", "recorded"]

_RECORDED: dict[str, str] = {}
_UNLOGGED: list[str] = []


def record(what: str, reason: str) -> bool:
    """Note that ``what`` fell back because of ``reason``; True the first time for ``what``."""
    if what in _RECORDED:
        return False
    _RECORDED[what] = reason
    line = f"fallback: {what}: {reason}"
    _UNLOGGED.append(line)
    warnings.warn(line, RuntimeWarning, stacklevel=3)
    return True


def recorded() -> dict[str, str]:
    """Every fallback of this process so far: what -> reason."""
    return dict(_RECORDED)


def drain() -> list[str]:
    """The fallback lines not handed out before (for the text log), oldest first."""
    lines = list(_UNLOGGED)
    _UNLOGGED.clear()
    return lines
