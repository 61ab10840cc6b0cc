"""Can this backend run this format here? The start-up verdicts that probe this process's device.

``check(backend, fmt, device)`` applies ``precision/capability.py``'s rules (the table of what
each backend runs on which GPU generation) to a real device, with the probes that need more
than the table: CUDA and the device's compute capability, ``transformer_engine``'s import and
its own availability functions, and the torch backend's scaled-mm probe
(``backends/scaled_mm.scaled_mm_support``, one small GEMM per format, operand pair and device).
``require`` turns failing verdicts into one ValueError with the fix; ``device_compute_capability``
is the compute capability of this process's CUDA device (None without one).

It sits above the backends' probe code (it imports ``backends/scaled_mm`` lazily, inside
``check``) and below their callers (``training/resolve.py``, ``snip/context.py``, ``TEBackend``);
the dry run asks the same rules about a GPU that is not here with ``capability.check_gpu_type``.
The probes are module-level functions so tests can substitute them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_snip.precision.capability import ARCH_NAMES, TE_MIN_COMPUTE_CAPABILITY, Capability, check_names
from megatron_snip.precision.scaled_mm_rules import OPERAND_PAIRS

__all__ = ["check", "device_compute_capability", "require"]

# TE's own availability functions per format (public API of transformer_engine.pytorch, TE >= 2.x).
_TE_AVAILABILITY_FN: dict[str, str] = {
    "fp8": "is_fp8_available",
    "fp8_block": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
    "nvfp4": "is_nvfp4_available",
}


def device_compute_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """Compute capability of ``device`` (default: the current CUDA device); None without CUDA."""
    if not _cuda_available():
        return None
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return _compute_capability(dev) if dev.type == "cuda" else None


# --- probes (module-level so tests can substitute them) ----------------------
def _te_import_error() -> str | None:
    """None if ``transformer_engine.pytorch`` imports, else the error text."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA/driver error raised at import
        return f"{type(e).__name__}: {e}"
    return None


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _te_reports(fmt: str) -> tuple[bool, str] | None:
    """TE's own verdict for ``fmt`` if this TE version exposes one, else None."""
    name = _TE_AVAILABILITY_FN.get(fmt)
    if name is None:
        return None
    import transformer_engine.pytorch as te

    fn = getattr(te, name, None)
    if fn is None:
        return None
    try:
        result = fn(return_reason=True)
    except TypeError:  # older signature without return_reason
        return (bool(fn()), "")
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1])
    return bool(result), ""


def _torch_backend_capability(fmt: str, device: torch.device | str | None) -> Capability:
    """The torch backend runs every format; the reason says which GEMMs are real scaled-mm ones."""
    if fmt == "bf16":
        return Capability(True, "bf16 GEMMs run unquantized")
    from megatron_snip.precision.backends.scaled_mm import scaled_mm_support  # the probe: built lazily

    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if _cuda_available() else torch.device("cpu"))
    verdicts = [scaled_mm_support(fmt, dev, a, b) for a, b in OPERAND_PAIRS]
    if all(ok for ok, _ in verdicts):
        return Capability(True, f"{fmt}: real scaled-mm GEMMs on {dev} ({verdicts[0][1]})")
    by_reason: dict[str, list[str]] = {}
    for (a, b), (ok, reason) in zip(OPERAND_PAIRS, verdicts):
        if not ok:
            by_reason.setdefault(reason, []).append(f"{a.value} x {b.value}")
    failed = "; ".join(f"{', '.join(pairs)}: {reason}" for reason, pairs in by_reason.items())
    return Capability(True, f"{fmt} on {dev}: emulated GEMM fallback for {failed}")


def check(backend: str, fmt: str, device: torch.device | str | None = None) -> Capability:
    """Can ``backend`` run GEMMs in ``fmt`` on ``device`` (default: the current CUDA device, or CPU)?

    Raises ValueError for an unknown backend or format name (bad input, not a capability).
    """
    check_names(backend, fmt)
    if backend == "emulated":
        return Capability(True, "emulated quantizers run every format on every device")
    if backend == "torch":
        return _torch_backend_capability(fmt, device)

    if fmt not in TE_MIN_COMPUTE_CAPABILITY:  # a recipe variant (get_format accepted the name)
        return Capability(False, f"{fmt} is a recipe variant; Transformer Engine runs its FP4 recipes only as "
                                 f"TE defines them, so {fmt} runs only emulated")
    need = TE_MIN_COMPUTE_CAPABILITY[fmt]
    if need is None:
        return Capability(False, f"Transformer Engine has no {fmt} recipe; {fmt} runs only emulated")
    err = _te_import_error()
    if err is not None:
        return Capability(False, f"transformer_engine not importable: {err}")
    if not _cuda_available():
        return Capability(False, "CUDA not available (Transformer Engine runs on NVIDIA GPUs only)")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return Capability(False, f"Transformer Engine runs on CUDA devices, not {dev}")
    have = _compute_capability(dev)
    if have < need:
        arch = ARCH_NAMES.get(need, "")
        return Capability(
            False,
            f"{fmt} in Transformer Engine needs compute capability >= {need[0]}.{need[1]}"
            f"{f' ({arch})' if arch else ''}; {dev} has {have[0]}.{have[1]}",
        )
    verdict = _te_reports(fmt)
    if verdict is not None and not verdict[0]:
        return Capability(False, f"Transformer Engine reports {fmt} unavailable: {verdict[1] or 'no reason given'}")
    return Capability(True, f"{fmt} via Transformer Engine on {dev} (compute capability {have[0]}.{have[1]})")


def require(backend: str, formats: Iterable[str], device: torch.device | str | None = None) -> None:
    """Raise ValueError unless ``backend`` can run every format in ``formats`` on ``device``.

    The message lists each failing format with its reason and the fix.
    """
    failures = {}
    for fmt in sorted(set(formats)):
        cap = check(backend, fmt, device)
        if not cap.ok:
            failures[fmt] = cap.reason
    if failures:
        lines = "; ".join(f"{f}: {r}" for f, r in failures.items())
        raise ValueError(
            f"precision.backend={backend!r} cannot run the plan's format(s) {sorted(failures)} - {lines}. "
            'Fix: set precision.backend="emulated" (runs every format, quantize-dequantize in PyTorch), '
            "or choose formats this device supports."
        )
