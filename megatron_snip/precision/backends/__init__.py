"""GEMM backends: one interface (``base.Backend``), chosen by ``precision.backend``.

* ``emulated`` - ``gemm.quant_linear``: quantize-dequantize in PyTorch, fp32
  GEMMs; runs every format everywhere (the reference).
* ``torch`` - the same autograd function with real FP8 GEMMs through PyTorch's
  scaled-mm per GEMM (``scaled_mm.py``), other formats emulated (recorded);
* ``te`` - Transformer Engine modules with a per-format recipe; needs CUDA and
  the GPU generation each recipe targets (the table in ``precision/capability.py``).

Pick one with ``get_backend(name)``; validate the plan's formats at start-up with
``support.require(name, formats, device)`` (``support.py``: the verdicts that probe this
device - the scaled-mm probe, TE's import - above the backends' code; ``capability.py`` holds
the pure tables and rules below them).

Imports: the modules of ``precision`` below it (``capability``, ``scaled_mm_rules``, ``gemm``,
``plan``, ``formats``, ``quantize``, ``fallbacks``). The submodules import one another one way -
``emulated`` and ``scaled_mm`` import ``base``; ``support`` imports ``scaled_mm`` (its probe);
``te`` imports ``base`` and ``support`` - and never this ``__init__``, which re-exports ``Backend``
for callers and builds the backends lazily in ``get_backend``.
"""

from __future__ import annotations

from megatron_snip.precision.backends.base import Backend
from megatron_snip.precision.capability import BACKENDS

__all__ = ["BACKENDS", "Backend", "get_backend"]


def get_backend(name: str, **options: object) -> Backend:
    """The backend called ``name`` (``"emulated"``, ``"torch"`` or ``"te"``), built with ``options``."""
    if name == "emulated":
        from megatron_snip.precision.backends.emulated import EmulatedBackend

        return EmulatedBackend(**options)  # type: ignore[arg-type]
    if name == "torch":
        from megatron_snip.precision.backends.scaled_mm import TorchBackend

        return TorchBackend(**options)  # type: ignore[arg-type]
    if name == "te":
        from megatron_snip.precision.backends.te import TEBackend

        return TEBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"precision.backend={name!r} is not one of {BACKENDS}")
