"""gpu_check's lines and check runner: one line per result, each check guarded and budgeted.

``line`` prints (flushed at once, so a run cut short has printed every line it reached) and keeps
each check's worst status; ``guarded`` turns a check's exception or its budget running out into one
FAIL line; ``fast_path_verdicts`` says which fallbacks a device should not need.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from collections.abc import Callable

FAILED: list[str] = []
SECONDS: dict[str, float] = {}  # check -> wall seconds (cold compiles included)
STATUS: dict[str, str] = {}  # check -> its worst line status (FAIL > OK > INFO)
TRITON_KEYS: set[tuple] = set()  # distinct Triton specializations launched (one compile each on a GPU)
CURRENT: list[str] = []  # the check running now
# The exceptions our signal handlers raised in the running check. A library may replace one with its
# own on the way up (torch's argument parser reports an interrupted conversion as a TypeError, Triton's
# interpreter wraps that in an InterpreterError), so the checks ask this list, not the exception type.
SIGNALLED: list[type[BaseException]] = []


class OverBudget(BaseException):
    """Raised in a check past its budget (a BaseException: no library ``except Exception`` hides it)."""


def _over_budget(signum, frame):
    SIGNALLED.append(OverBudget)
    raise OverBudget


def on_sigint(signum, frame):
    """SIGINT's handler (gpu_check.sh's ``timeout --signal=INT``): Python's own, remembered."""
    SIGNALLED.append(KeyboardInterrupt)
    raise KeyboardInterrupt


def raise_if_signalled(e: Exception | None) -> None:
    """Raise the signal's own exception if one was raised in this check, from ``e`` (what a library
    raised in its place, or None), so that an ``except Exception`` meant for a refusal cannot
    swallow a cut; else return."""
    if SIGNALLED:
        raise SIGNALLED[-1]() from e


def line(name: str, figure: str, status: str = "INFO") -> None:
    if status == "FAIL":
        FAILED.append(name)
    if CURRENT:
        rank = {"INFO": 0, "OK": 1, "FAIL": 2}
        old = STATUS.get(CURRENT[0], "INFO")
        STATUS[CURRENT[0]] = status if rank[status] > rank[old] else old
    print(f"{name:<12} {figure} ... {status}", flush=True)


def guarded(fn: Callable[..., None]) -> Callable[..., None]:
    """A check that raises prints one FAIL line with the error instead of ending the run; one past its
    budget (``budget_s``, None: not enforced) is cut with a FAIL line; its time is kept either way. A
    SIGINT or budget alarm counts as itself even where a library replaced or dropped its exception."""
    name = fn.__name__.removeprefix("check_")

    def run(*args, budget_s: float | None = None, **kwargs):
        t0 = time.perf_counter()
        CURRENT[:] = [name]
        SIGNALLED.clear()
        try:
            try:
                try:
                    if budget_s is not None:
                        signal.signal(signal.SIGALRM, _over_budget)
                        signal.setitimer(signal.ITIMER_REAL, budget_s)
                    fn(*args, **kwargs)
                    raise_if_signalled(None)  # one a library caught and dropped: still a cut
                finally:  # disarmed before anything else runs (an alarm in this window lands below)
                    if budget_s is not None:
                        signal.setitimer(signal.ITIMER_REAL, 0)
            except Exception as e:  # a signal's exception in a library's disguise?
                raise_if_signalled(e)
                raise
        except OverBudget:
            line(name, f"cut at its {budget_s:.3g} s budget (the lines above are what it reached)", "FAIL")
        except Exception as e:  # noqa: BLE001 - report and go on to the next check
            line(name, f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", "FAIL")
            traceback.print_exc(file=sys.stderr)
        except KeyboardInterrupt:  # the run is being cut: main() names this check (CURRENT kept)
            SECONDS[name] = time.perf_counter() - t0
            raise
        SECONDS[name] = time.perf_counter() - t0
        CURRENT.clear()
    run.check_name = name
    return run


# The fallback records (``precision.fallbacks``) of the fast paths a CUDA device must run: the quantize
# kernels (compiled.cuda_kernels / kernel_failed), torch.compile of the quantizers and of the blocks.
FAST_PATHS = ("Triton quantize kernels", "torch.compile of the quantizers", "training.compile:")


def fast_path_verdicts(recorded: dict[str, str], device, scaled_mm_expected: Callable[[str], bool],
                       backend_fallbacks: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(line, status) for each fallback ``recorded`` (``precision.fallbacks``, what -> reason) and each
    of a torch backend's own (``backend_fallbacks``): FAIL where this device should run the fast path.

    On CUDA the quantize kernels must run (CUDA torch wheels bring Triton; ``[kernels]``), and so
    must torch.compile where it is used (a compile failure); a torch without the eager-numerics
    options is a documented limit (INFO); a scaled-mm fallback fails where PyTorch documents a
    scaled-mm for the format (``scaled_mm_expected(fmt)``) and the backend was asked to run it (on CPU
    a backend without ``cpu_reference`` runs emulated by design: ``CPU_REASON``, INFO). On CPU the
    kernel and compile fallbacks are INFO (the kernels are a GPU path).
    """
    cuda = device.type == "cuda"
    out = []
    for what, reason in recorded.items():
        if what.startswith("torch backend "):
            continue  # per backend below: another check's GEMM fallback says nothing of this one
        fail = cuda and what.startswith(FAST_PATHS)
        out.append((f"{what}: {reason}"[:300], "FAIL" if fail else "INFO"))
    from megatron_snip.precision.backends.scaled_mm import CPU_REASON

    for key, reason in (backend_fallbacks or {}).items():  # "<fmt> <a kind> x <b kind> on <device>"
        fail = scaled_mm_expected(key.split()[0]) and reason != CPU_REASON  # CPU's emulated GEMMs: by design
        out.append((f"torch backend {key} runs the emulated GEMM: {reason}"[:300], "FAIL" if fail else "INFO"))
    return out


def report_fallbacks(name: str, device, backend_fallbacks: dict[str, str] | None) -> None:
    """One line per fallback of the run just checked (``fast_path_verdicts``), or one OK line if none."""
    from megatron_snip.precision import fallbacks
    from megatron_snip.precision.backends.scaled_mm import scaled_mm_expected

    verdicts = fast_path_verdicts(fallbacks.recorded(), device, lambda f: scaled_mm_expected(f, device)[0],
                                  backend_fallbacks)
    for figure, status in verdicts:
        line(name, f"fallback: {figure}", status)
    if not any(status == "FAIL" for _, status in verdicts):
        line(name, f"fast paths: no fallback this device should not need ({len(verdicts)} documented ones above)", "OK")
