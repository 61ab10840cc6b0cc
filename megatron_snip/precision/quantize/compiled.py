"""Fast variants of the block-scaling math: Triton kernels on CUDA, torch.compile'd graphs elsewhere.

``_run_qdq`` picks, per call: on a CUDA tensor the fused Triton kernel of ``snip_kernels/``
(``snip_kernels.quantize``, called by ``kernel_calls.qdq``) when Triton imports; otherwise, with ``compiled=True``, a
torch.compile'd copy of ``blocks._qdq`` cached per format/operand/layout/shape (for the operands
``draws_apart`` names, two: the stochastic-rounding draws, then ``blocks._qdq_noise``); otherwise
``blocks._qdq`` itself. Every variant gives the eager reference's bits (NaN payloads aside):

  * CPU, compiled: inductor's C++ code divides exactly and keeps the operation order
    (tests/unit/test_quantize.py::test_compiled_matches_eager);
  * CUDA, compiled: inductor's Triton division is approximate by default, so graphs are
    compiled with its eager-numerics options (correctly rounded division, no flush-to-zero,
    no FMA contraction: ``_EXACT_OPTIONS``); a torch without the division option runs
    eager instead (recorded) - checked on a GPU by scripts/gpu_check.sh;
  * CUDA, kernels: bitwise by construction (see ``snip_kernels/quantize.py``), checked under the
    Triton interpreter in CI and on a GPU by scripts/gpu_check.sh.

Failures never stop a run and are never silent: a kernel or compile failure falls back (to
the next variant) and is recorded once with its cause (``precision/fallbacks.py``: a
warning and a line in the run's text log). A compile failure is first retried once in an
inductor cache directory private to this process: several processes compiling into one
shared cache can load each other's half-written artifacts (seen: ``ImportError: ...main.so:
file too short``), and the private directory also keeps this process's later compiles out
of the race.
"""

from __future__ import annotations

import os
import socket
import types
from collections.abc import Callable

import torch

from megatron_snip.precision import fallbacks
from megatron_snip.precision.formats import Format, Operand
from megatron_snip.precision.quantize.blocks import _qdq, _qdq_noise, stochastic_noise

_QdqFn = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]
_CompileKey = tuple  # (format, operand, hadamard, colwise, physical shape, device type, has amax, has seeds)
# or ("noise", colwise, physical shape, device type) for the stochastic-rounding draws
_COMPILED: dict[_CompileKey, _QdqFn] = {}
_COMPILE_ERROR: list[str] = []  # the first failure; after it everything runs eager


def _qdq_template(p: torch.Tensor, amax: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor:
    return _qdq(p, _SPEC, _OPERAND, _HADAMARD, _COLWISE, amax, seeds)  # type: ignore[name-defined]  # noqa: F821


def _qdq_noise_template(p: torch.Tensor, amax: torch.Tensor | None, noise: torch.Tensor | None) -> torch.Tensor:
    return _qdq_noise(p, _SPEC, _OPERAND, _HADAMARD, _COLWISE, amax, noise)  # type: ignore[name-defined]  # noqa: F821


def _noise_template(p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    return stochastic_noise(p, _COLWISE, seeds)  # type: ignore[name-defined]  # noqa: F821


def _specialized(template: Callable, name: str, **constants: object) -> Callable:
    """A copy of ``template`` with its own code object and ``constants`` bound as globals.

    torch.compile keeps compiled graphs, guards and its recompile budget (8) per code
    object. One code object per compile key (``name`` includes the shape) means each holds
    exactly one graph: no variant evicts another or silently falls back to eager after
    8 shapes, and a call checks one set of guards instead of trying several.
    """
    code = template.__code__.replace(co_name=name)
    return types.FunctionType(code, dict(globals(), **constants), name)


def _exact_options() -> dict[str, bool] | None:
    """Inductor options under which its Triton code rounds as eager CUDA does, or None if unavailable.

    Correctly rounded fp32 division (``tl.div_rn``) instead of Triton's approximate ``/``,
    no denormal flush, no FMA contraction. The option names moved between torch versions.
    """
    from torch._inductor import config as inductor_config

    opts = {"emulate_precision_casts": True}  # also turns off FMA contraction (enable_fp_fusion)
    numerics = getattr(inductor_config, "eager_numerics", None)
    if numerics is not None and hasattr(numerics, "division_rounding"):
        opts["eager_numerics.division_rounding"] = True
        if hasattr(numerics, "disable_ftz"):
            opts["eager_numerics.disable_ftz"] = True
        return opts
    if hasattr(inductor_config, "emulate_divison_rounding"):  # older torch (sic)
        opts["emulate_divison_rounding"] = True
        return opts
    return None


def eager_numerics_options() -> dict[str, bool] | None:
    """Inductor's eager-numerics options for CUDA graphs (``_exact_options``), or None if this torch
    has none; ``model/compiled_regions.py`` compiles the block regions with the same ones."""
    return _exact_options()


def _compile_key(spec: Format, operand: Operand, hadamard: bool, colwise: bool, p: torch.Tensor, amax: object,
                 seeds: object) -> _CompileKey:
    return (spec, operand, hadamard, colwise, tuple(p.shape), p.device.type, amax is None, seeds is None)


def _get_compiled(
    spec: Format, operand: Operand, hadamard: bool, colwise: bool, p: torch.Tensor, amax: object, seeds: object
) -> _QdqFn:
    # Static shapes: a training run sees a handful of fixed operand shapes, and static
    # kernels measured several times faster than dynamic=True ones here (symbolic block
    # reshapes and noise counters defeat vectorization: 0.06 vs 0.5 Gelem/s for nvfp4
    # gradients). The Format itself (frozen, compared by value) is in the key: a modified
    # spec under the same name gets its own kernel.
    key = _compile_key(spec, operand, hadamard, colwise, p, amax, seeds)
    fn = _COMPILED.get(key)
    if fn is None:
        name = (f"qdq_{spec.name}_{operand.value}{'_rht' if hadamard else ''}{'_colwise' if colwise else ''}"
                f"_{p.shape[0]}x{p.shape[1]}{'_amax' if amax is not None else ''}")
        options = _exact_options() if p.device.type == "cuda" else None
        body = _qdq_noise_template if draws_apart(spec, operand, colwise) else _qdq_template  # (p, amax, noise)
        template = _specialized(body, name, _SPEC=spec, _OPERAND=operand, _HADAMARD=hadamard, _COLWISE=colwise)
        fn = torch.compile(template, dynamic=False, options=options)
        _COMPILED[key] = fn
    return fn


def draws_apart(spec: Format, operand: Operand, colwise: bool) -> bool:
    """Whether the compiled quantizer makes an operand's stochastic-rounding draws in a kernel of
    their own (``blocks._qdq_noise``) rather than inside its block loop: for row-blocked operands
    with blocks wider than 16 (fp4_block's 1x128, mxfp4's 1x32 gradient tiles). Fused there,
    inductor's CPU code ran 2.2-6x slower than the two kernels apart; elsewhere (colwise, nvfp4's
    16-wide blocks) fused was 10-40% faster (``python -m experiments.bench.quantizers --sr-draws``,
    docs/bench/sr_draws.txt). The bits are the same either way."""
    return spec.stochastic_for(operand) and not colwise and spec.block_for(operand)[1] > 16


def _get_compiled_noise(colwise: bool, p: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The compiled ``blocks.stochastic_noise`` for operands shaped like ``p`` (integer arithmetic:
    the same bits as eager on every device)."""
    key = ("noise", colwise, tuple(p.shape), p.device.type)
    fn = _COMPILED.get(key)
    if fn is None:
        name = f"sr_noise{'_colwise' if colwise else ''}_{p.shape[0]}x{p.shape[1]}"
        fn = torch.compile(_specialized(_noise_template, name, _COLWISE=colwise), dynamic=False)
        _COMPILED[key] = fn
    return fn


def compiled_quantizers_available() -> tuple[bool, str]:
    """(False, reason) once a compilation has failed in this process (everything then runs eager)."""
    return (not _COMPILE_ERROR, _COMPILE_ERROR[0] if _COMPILE_ERROR else "")


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _use_private_cache_dir() -> str:
    """Point inductor's cache at a directory of this process only (for the rest of the process)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    private = os.path.join(cache_dir(), f"private-{socket.gethostname()}-{os.getpid()}")
    os.makedirs(private, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = private
    return private


def _run_compiled(p: torch.Tensor, spec: Format, operand: Operand, hadamard: bool, colwise: bool,
                  amax: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor | None:
    """The compiled variant's result, or None after recording why it cannot run."""
    if p.device.type == "cuda" and _exact_options() is None:
        _COMPILE_ERROR.append("this torch's inductor has no correctly rounded division option")
        fallbacks.record("compiled quantizers (running eager)", _COMPILE_ERROR[0])
        return None
    def run() -> torch.Tensor:
        fn = _get_compiled(spec, operand, hadamard, colwise, p, amax, seeds)
        if seeds is not None and draws_apart(spec, operand, colwise):
            return fn(p, amax, _get_compiled_noise(colwise, p)(p, seeds))
        return fn(p, amax, seeds)

    try:
        return run()
    except Exception as first:  # noqa: BLE001 - any compiler failure: retry privately, then fall back
        _COMPILED.pop(_compile_key(spec, operand, hadamard, colwise, p, amax, seeds), None)
        _COMPILED.pop(("noise", colwise, tuple(p.shape), p.device.type), None)
        private = _use_private_cache_dir()
        try:
            return run()
        except Exception as second:  # noqa: BLE001
            _COMPILE_ERROR.append(f"{_first_line(first)}; retried in the private cache {private}: "
                                  f"{_first_line(second)}")
            fallbacks.record("torch.compile of the quantizers failed; running them eagerly (identical numerics, "
                             "~10x slower)", _COMPILE_ERROR[0])
            return None


_KERNELS: list = []  # [the kernel_calls module] once imported, [None] when unavailable or failed


def cuda_kernels() -> types.ModuleType | None:
    """``quantize.kernel_calls`` (the callers of ``snip_kernels.quantize``) for CUDA operands, or None
    (unavailable or failed: recorded once)."""
    if not _KERNELS:
        try:
            import megatron_snip.precision.quantize.kernel_calls as module
        except Exception as e:  # noqa: BLE001 - ImportError, or Triton failing to initialize
            fallbacks.record("Triton quantize kernels unavailable (CUDA quantizers run in PyTorch)",
                             f"{_first_line(e)}; install them with pip install -e \".[kernels]\"")
            module = None
        _KERNELS.append(module)
    return _KERNELS[0]


def kernel_failed(e: BaseException) -> None:
    """Stop using the kernels in this process after one failed to build or launch; recorded once."""
    _KERNELS[:] = [None]
    fallbacks.record("Triton quantize kernels failed (CUDA quantizers run in PyTorch)", _first_line(e))


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
    """``blocks._qdq`` through the fastest variant that runs here (see the module docstring).

    ``p`` may be bf16 or fp16 (``quantize`` passes it uncopied where the kernels run): the kernels
    read it as it is, every other variant gets an fp32 copy (widening is exact: the same bits)."""
    if p.device.type == "cuda" and cuda_kernels() is not None:
        try:
            return cuda_kernels().qdq(p, spec, operand, hadamard, colwise, amax, seeds)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to build or launch: fall back, once
            kernel_failed(e)
    p = p.to(torch.float32)
    if compiled and not _COMPILE_ERROR:
        y = _run_compiled(p, spec, operand, hadamard, colwise, amax, seeds)
        if y is not None:
            return y
    return _qdq(p, spec, operand, hadamard, colwise, amax, seeds)
