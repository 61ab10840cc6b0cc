"""Labels for torch.profiler traces (``training.profile_steps``): the quantizer and GEMM regions.

``label("quantize", "nvfp4", "weight")`` is ``torch.profiler.record_function("quantize:nvfp4:weight")``
while a profiler is recording, and a shared no-op context otherwise: the name is not even formatted,
and no ``RecordFunction`` is created, so a run without ``profile_steps`` pays one attribute read and
one call per region (measured in tests/unit/test_profile.py against the step time). The names:

* ``quantize:<format>:<operand>`` - one quantize-dequantize of a GEMM operand (``activation``,
  ``weight`` or ``gradient``), in ``precision/quantize``;
* ``gemm:<fprop|dgrad|wgrad>:<format>`` - one GEMM of a linear with its operands' quantization
  (``precision/gemm.py``, every backend but ``te``, whose modules run their own GEMMs).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.autograd.profiler as _profiler

_OFF = contextlib.nullcontext()


def label(*parts: str) -> Any:
    """A ``record_function`` named ``":".join(parts)`` while profiling, else a no-op context."""
    if not _profiler._is_profiler_enabled:  # set by torch.profiler.profile on entry, cleared on exit
        return _OFF
    return _profiler.record_function(":".join(parts))
