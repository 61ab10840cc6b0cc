"""torch.compile'd variants of the block-scaling math, cached per format/operand/layout/shape."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import torch

from megatron_snip.precision.formats import Format, Operand
from megatron_snip.precision.quantize.blocks import _qdq

_QdqFn = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]
_CompileKey = tuple  # (format, operand, hadamard, colwise, physical shape, device type, has amax, has seeds)
_COMPILED: dict[_CompileKey, _QdqFn] = {}
_COMPILE_ERROR: list[str] = []  # the first failure; after it everything runs eager


def _qdq_template(p: torch.Tensor, amax: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor:
    return _qdq(p, _SPEC, _OPERAND, _HADAMARD, _COLWISE, amax, seeds)  # type: ignore[name-defined]  # noqa: F821


def _specialized(spec: Format, operand: Operand, hadamard: bool, colwise: bool, tag: str = "") -> _QdqFn:
    """A copy of ``_qdq_template`` with its own code object and its constants bound as globals.

    torch.compile keeps compiled graphs, guards and its recompile budget (8) per code
    object. One code object per compile key (``tag`` names the shape) means each holds
    exactly one graph: no variant evicts another or silently falls back to eager after
    8 shapes, and a call checks one set of guards instead of trying several.
    """
    name = f"qdq_{spec.name}_{operand.value}{'_rht' if hadamard else ''}{'_colwise' if colwise else ''}{tag}"
    code = _qdq_template.__code__.replace(co_name=name)
    glb = dict(globals(), _SPEC=spec, _OPERAND=operand, _HADAMARD=hadamard, _COLWISE=colwise)
    return types.FunctionType(code, glb, name)


def _get_compiled(
    spec: Format, operand: Operand, hadamard: bool, colwise: bool, p: torch.Tensor, amax: object, seeds: object
) -> _QdqFn:
    # Static shapes: a training run sees a handful of fixed operand shapes, and static
    # kernels measured several times faster than dynamic=True ones here (symbolic block
    # reshapes and noise counters defeat vectorization: 0.06 vs 0.5 Gelem/s for nvfp4
    # gradients). The Format itself (frozen, compared by value) is in the key: a modified
    # spec under the same name gets its own kernel.
    key = (spec, operand, hadamard, colwise, tuple(p.shape), p.device.type, amax is None, seeds is None)
    fn = _COMPILED.get(key)
    if fn is None:
        tag = f"_{p.shape[0]}x{p.shape[1]}{'_amax' if amax is not None else ''}"
        fn = torch.compile(_specialized(spec, operand, hadamard, colwise, tag), dynamic=False)
        _COMPILED[key] = fn
    return fn


def compiled_quantizers_available() -> tuple[bool, str]:
    """(False, reason) once a compilation has failed in this process (everything then runs eager)."""
    return (not _COMPILE_ERROR, _COMPILE_ERROR[0] if _COMPILE_ERROR else "")


def _run_qdq(
    p: torch.Tensor,
    spec: Format,
    operand: Operand,
    hadamard: bool,
    colwise: bool,
    amax: torch.Tensor | None,
    seeds: torch.Tensor | None,
    compiled: bool,
) -> torch.Tensor:
    if compiled and not _COMPILE_ERROR:
        try:
            return _get_compiled(spec, operand, hadamard, colwise, p, amax, seeds)(p, amax, seeds)
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, loudly, once
            first_line = str(e).splitlines()[0] if str(e) else ""
            _COMPILE_ERROR.append(f"{type(e).__name__}: {first_line}")
            warnings.warn(
                f"torch.compile of the quantizers failed ({_COMPILE_ERROR[0]}); running them eagerly "
                "(identical numerics, ~10x slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    return _qdq(p, spec, operand, hadamard, colwise, amax, seeds)
