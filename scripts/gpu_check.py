"""One device check of the GPU fast path: prints one line per check with its figure.

Run through ``scripts/gpu_check.sh`` (which bounds the whole script to 6 minutes); needs no network.
Checks, in order of value - bitwise numerics, scaled-mm, the one-line probes, SNIP end to end, then
timings - each with a budget (``BUDGET_S``, seconds on one H200 with cold caches): a check past its
budget is cut with a FAIL line and the next one runs, so the budgets bound the run by design
(``name: figure ... OK|FAIL|INFO``; each says what it exercised):
  env         torch / CUDA / GPU / Triton versions; Transformer Engine and apex presence (TE is
              not checked here: its wheel does not fit the offline image; tests/gpu/test_te_*.py)
  bitwise     Triton kernels and device-eager quantizers vs the CPU reference on the test input classes
  scaled_op   the float8 elements + scales the torch backend feeds scaled-mm (Triton ``scaled_operand``)
              vs the CPU reference, bitwise
  scaled_mm   per format and operand pair: real scaled-mm or emulated, and whether PyTorch documents
              a scaled-mm for it here (``scaled_mm_expected``): a fallback where it does is a FAIL
  gemm_<fmt>  torch-backend GEMMs (fprop/dgrad/wgrad) vs the exact product of their operands, within
              the 14-bit accumulation bound (fp8 fprop: the fast-accum bound, ``fast_accum_for``);
              FAIL on a fallback where scaled-mm is expected
  probes      one line each (scripts/gpu_check_probes.py): scale_pad (does cuBLAS need 128x128 scales
              padded: K = 1280), div_rn_ftz (does Triton's div_rn flush subnormals), stop_flag (does a
              4-byte pinned copy read the stop flag at execution)
  tiny_snip   tiny on this device (torch backend) with SNIP re-planning once: losses finite, plans
              written; a Triton-kernel, compiled-quantizer or scaled-mm fallback the device should not
              need is a FAIL
  sync_free   a tiny run's steady-state steps make no host sync (CUDA: set_sync_debug_mode("error")
              and the framework's counter, which also sees pageable host-to-device copies)
  compiled    torch.compile'd quantizers on the device (eager-numerics options) vs the CPU reference
  copy_bw     device-to-device copy bandwidth (bytes read + written / s)
  kernel_bw   quantize-kernel throughput as a fraction of copy_bw, per format, counting the bytes each
              call really moves (``precision/quantize/kernel_calls.bytes_moved``: the kernel's one
              read and one write, plus one read of the input for a tensor amax; the RHT is fused)
  step_*      a llama_1b-shaped block stack (synthetic tokens): step times of BF16, torch-backend
              FP8, emulated NVFP4, a mixed per-GEMM FP8/BF16 plan; ratios side by side; fallbacks as
              in tiny_snip are FAILs
  compiles    Triton kernel specializations launched and torch.compile graphs built (each a cold
              compile on a fresh machine)
  budget      the budget table: each check's budget, the seconds it took, its status
Every line is flushed as it is printed; when the run is cut short (SIGINT from gpu_check.sh's
timeout) it prints where it stopped and the budget table before exiting.
``--smoke`` runs the checks at toy sizes on CPU (kernels under TRITON_INTERPRET=1; the torch backend
with CPU's reference scaled-mm) to test this script itself; its figures mean nothing and budgets are
not enforced (``--budget-scale`` enforces them scaled, e.g. to test the cut).
``--force-fallback`` makes every scaled-mm call fail (to see the checks fail on fallbacks);
``--only a,b`` runs the named checks only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback

from gpu_check_report import CURRENT, FAILED, SECONDS, STATUS, guarded, line, on_sigint, raise_if_signalled
from gpu_check_runs import FORMATS_Q, check_bandwidth, check_steps, check_sync_free, check_tiny_snip, torch_backend

# Seconds each check may take on one H200, cold Triton / Inductor caches included (estimates: 42
# Triton specializations at ~1 s each in bitwise/scaled_op, tiny's 6 steps and one re-plan, 5 steps
# of 4 llama_1b blocks per plan, a 6-step BF16 tiny run). Their sum + the start-up must stay within PY_LIMIT_S, the limit
# gpu_check.sh gives this script, and that + the ratios' limit within 6 minutes
# (tests/unit/test_gpu_check_rules.py checks both sums against gpu_check.sh).
BUDGET_S = {"env": 10, "bitwise": 50, "scaled_op": 25, "scaled_mm": 15, "gemms": 15, "probes": 15,
            "tiny_snip": 55, "sync_free": 15, "compiled": 40, "bandwidth": 25, "steps": 50}
COMPILE_START_S = BUDGET_S["compiled"] * 3 // 4  # the compiled check starts no new compile after this
STARTUP_S = 15  # importing torch and the package, CUDA context creation, the final lines
PY_LIMIT_S = 330  # gpu_check.sh: timeout --signal=INT 330 python3 scripts/gpu_check.py
SCRIPT_LIMIT_S = 360  # the whole gpu_check.sh, by design
TRITON_KEYS: set[tuple] = set()  # distinct Triton specializations launched (one compile each on a GPU)


def bits_equal(a, b) -> bool:
    import torch

    a, b = a.detach().cpu(), b.detach().cpu()
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na].contiguous().view(torch.int32), b[~nb].contiguous().view(torch.int32))


def test_inputs(rows: int, smoke: bool) -> dict:
    """The bit-exactness input classes (snip_kernels/cases.py), (rows, 256); --smoke: three of them at
    (rows, 128) - the interpreter is slow, and tests/unit/test_kernels.py covers every class."""
    from snip_kernels.cases import input_classes

    classes = input_classes(rows, 128 if smoke else 256)
    return {k: v for k, v in classes.items() if k in ("gaussian", "midpoints", "nan_inf")} if smoke else classes


@guarded
def check_env(device, smoke: bool) -> None:
    import torch

    parts = [f"torch {torch.__version__}"]
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        parts += [f"CUDA {torch.version.cuda}", torch.cuda.get_device_name(device), f"sm_{cc[0]}{cc[1]}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("no triton")
    for mod in ("transformer_engine", "apex", "ortools"):
        try:
            __import__(mod)
            parts.append(f"{mod} present")
        except Exception:  # noqa: BLE001
            parts.append(f"no {mod}")
    line("env", ", ".join(parts))
    line("te", "skipped: Transformer Engine is not checked here (its wheel does not fit the offline image; the te "
         "backend's GPU tests are tests/gpu/test_te_*.py, run where TE is installed)")


@guarded
def check_scaled_mm(device, smoke: bool) -> None:
    from megatron_snip.precision.backends.scaled_mm import scaled_mm_expected, scaled_mm_support
    from megatron_snip.precision.scaled_mm_rules import OPERAND_PAIRS

    for fmt in FORMATS_Q:
        expected, why = scaled_mm_expected(fmt, device)
        verdicts = [scaled_mm_support(fmt, device, a, b, cpu_reference=device.type == "cpu") for a, b in OPERAND_PAIRS]
        pairs = " ".join(f"{a.value[0]}x{b.value[0]}={'real' if ok else 'emulated'}"
                         for (a, b), (ok, _) in zip(OPERAND_PAIRS, verdicts))
        reasons = sorted({r for ok, r in verdicts if not ok})
        if expected:
            status = "OK" if not reasons else "FAIL"
            figure = f"{fmt}: {pairs}; scaled-mm expected here" + (
                f"; fallback: {'; '.join(reasons)[:240]}" if reasons else f" ({verdicts[0][1]})")
        else:
            status = "INFO"
            figure = f"{fmt}: {pairs}; not expected here ({why})"
        line("scaled_mm", figure, status)


# (T, K, N) of the gemm check (tests/unit/test_gpu_shapes.py runs them through scaled_mm_shape_error).
GEMM_TKN = {False: (4096, 4096, 4096), True: (128, 512, 1024)}  # K, N multiples of 512 (128x128 scales)

# The operands of each GEMM of a linear Y = X·Wᵀ as gemm.quant_linear hands them to its runner (a·bᵀ).
GEMM_OPERANDS = {
    "fprop": lambda x, w, dy: (x, "activation", w, "weight"),
    "dgrad": lambda x, w, dy: (dy, "gradient", w.t(), "weight"),
    "wgrad": lambda x, w, dy: (dy.t(), "gradient", x.t(), "activation"),
}


@guarded
def check_gemms(device, smoke: bool) -> None:
    import torch

    from megatron_snip.precision.backends.scaled_mm import (
        SCALED_FORMATS,
        accumulation_tolerance,
        fast_accum_for,
        gemm_error,
        magnitude_ratio,
        scaled_mm_expected,
    )
    from megatron_snip.precision.plan import GemmPrecision
    from megatron_snip.precision.quantize import quantize

    t, k, n = GEMM_TKN[smoke]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, k, device=device, generator=g)
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    dy = torch.randn(t, n, device=device, generator=g)
    for fmt in SCALED_FORMATS:
        be = torch_backend(device)
        xx, ww = x.clone().requires_grad_(True), torch.nn.Parameter(w.clone())
        y = be.linear(xx, ww, GemmPrecision.uniform(fmt))
        y.backward(dy)
        errs, tols = {}, {}
        for (gemm, operands), got in zip(GEMM_OPERANDS.items(), (y.detach(), xx.grad, ww.grad)):
            a, a_kind, b, b_kind = operands(x, w, dy)  # fp8/fp8_block round to nearest: quantize() is the operand
            errs[gemm] = gemm_error(got, quantize(a, fmt, a_kind), quantize(b, fmt, b_kind))
            # fprop of fp8 accumulates fast (no promotion), as TE: its bound is the derived fast one
            tols[gemm] = accumulation_tolerance(a.shape[1], fast_accum_for(fmt, a_kind, b_kind),
                                                magnitude_ratio(quantize(a, fmt, a_kind), quantize(b, fmt, b_kind)))
        falls = dict(be.fallbacks)
        expected, why = scaled_mm_expected(fmt, device)
        figure = ("error vs exact product of the operands (bound) "  # each GEMM its own bound: fp8 fprop's is fast-accum's
                  + " ".join(f"{gm} {errs[gm]:.1e} ({tols[gm]:.1e})" for gm in errs) + "; exercised: "
                  + ("scaled-mm for fprop, dgrad, wgrad" if not falls else "emulated fallback for "
                     + "; ".join(f"{key}: {reason}" for key, reason in falls.items())[:240]))
        within = all(errs[gm] <= tols[gm] for gm in errs)
        if expected:
            status = "OK" if within and not falls else "FAIL"
        else:
            status = "OK" if within else "FAIL"
            figure += f" (scaled-mm not expected here: {why})"
        line(f"gemm_{fmt}", figure, status)


@guarded
def check_bitwise(device, smoke: bool) -> None:
    import torch

    from megatron_snip.precision.formats import Operand, get_format
    from megatron_snip.precision.quantize.blocks import _qdq
    from megatron_snip.precision.quantize.kernel_calls import qdq
    from megatron_snip.precision.quantize.noise import draw_seeds

    total = kernel_ok = eager_ok = 0
    bad: list[str] = []
    for fmt in FORMATS_Q:
        spec = get_format(fmt)
        for operand in Operand:
            rows = max(32, spec.block_for(operand)[0])  # 2-D weight blocks (fp8_block, fp4_block: 128 rows)
            for name, x in test_inputs(rows, smoke).items():
                for hadamard in (False, True) if operand is not Operand.WEIGHT else (False,):
                    for colwise in (False, True):
                        p = x.t().contiguous() if colwise else x
                        seeds = draw_seeds(torch.Generator().manual_seed(total), "cpu") \
                            if spec.stochastic_for(operand) else None
                        want = _qdq(p, spec, operand, hadamard, colwise, None, seeds)
                        pd, sd = p.to(device), None if seeds is None else seeds.to(device)
                        k = bits_equal(qdq(pd, spec, operand, hadamard, colwise, None, sd), want)
                        e = bits_equal(_qdq(pd, spec, operand, hadamard, colwise, None, sd), want)
                        total += 1
                        kernel_ok += k
                        eager_ok += e
                        if not (k and e) and len(bad) < 4:
                            bad.append(f"{fmt}/{operand.value}/{name}/h{int(hadamard)}/c{int(colwise)}"
                                       f"{'' if k else ' kernel'}{'' if e else ' eager'}")
    line("bitwise", f"kernels {kernel_ok}/{total}, {device.type}-eager {eager_ok}/{total} bit-identical to the CPU "
         f"reference" + (f"; first mismatches: {bad}" if bad else ""), "OK" if kernel_ok == eager_ok == total else "FAIL")


@guarded
def check_scaled_op(device, smoke: bool) -> None:
    import torch

    from megatron_snip.precision.formats import Operand, get_format
    from megatron_snip.precision.quantize.kernel_calls import scaled_operand
    from megatron_snip.precision.quantize.scaled import SCALED_FORMATS, ScaledOperand, dequantize, quantize_scaled

    total = ok = 0
    bad: list[str] = []
    for fmt in SCALED_FORMATS:
        spec = get_format(fmt)
        for operand in Operand:
            for name, x in test_inputs(128, smoke).items():
                for layout in ("rows", "cols"):  # a transposed view is read in place (the wgrad operands)
                    for dtype in (torch.float32, torch.bfloat16):
                        v = (x if layout == "rows" else x.t().contiguous().t()).to(dtype)
                        want = quantize_scaled(v, fmt, operand)  # the CPU reference (scaled_elements)
                        elements, scale = scaled_operand(v.to(device), spec, operand, None)
                        got = ScaledOperand(elements, scale)
                        # elements as values, any NaN equal to any NaN (payloads may differ); the
                        # interpreter's float8 cast maps NaN to -max (a GPU keeps NaN): --smoke
                        # compares those through the decoded operand only
                        same = (elements.dtype == want.elements.dtype and bits_equal(scale, want.scale)
                                and bits_equal(dequantize(got), dequantize(want))
                                and (smoke and name == "nan_inf" or bits_equal(elements.float(), want.elements.float())))
                        total += 1
                        ok += same
                        if not same and len(bad) < 4:
                            bad.append(f"{fmt}/{operand.value}/{name}/{layout}/{str(dtype)[6:]}")
    line("scaled_op", f"{ok}/{total} scaled-mm operands (float8 elements + decode scales from the Triton kernel on "
         f"{device.type}) bit-identical to the CPU reference" + (f"; first mismatches: {bad}" if bad else ""),
         "OK" if ok == total else "FAIL")


@guarded
def check_compiled(device, smoke: bool) -> None:
    import torch

    from megatron_snip.precision.formats import Operand, get_format
    from megatron_snip.precision.quantize import compiled
    from megatron_snip.precision.quantize.blocks import _qdq
    from megatron_snip.precision.quantize.noise import draw_seeds
    from snip_kernels.cases import input_classes

    total = ok = 0
    t0 = time.perf_counter()
    # One compile per (format, operand kind): several input classes stacked by rows (NaN/Inf
    # would poison whole tensors or blocks and hide the rest; the bitwise check covers them).
    # Every format's activation variant first, then the others, while 3/4 of the check's budget is
    # left: each is a cold Inductor compile on a fresh machine, and 18 of them could eat the run.
    variants = [(fmt, operand, hadamard) for operand, hadamard in (
        (Operand.ACTIVATION, False), (Operand.GRADIENT, True), (Operand.WEIGHT, False)) for fmt in FORMATS_Q]
    if smoke:  # one CPU compile exercises the path (tests/unit/test_quantize.py compiles the rest)
        variants = variants[:1]
    for fmt, operand, hadamard in variants:
        if time.perf_counter() - t0 > COMPILE_START_S:
            break
        spec = get_format(fmt)
        classes = input_classes(32, 256)
        x = torch.cat([classes[n] for n in ("gaussian", "midpoints", "subnormal", "outlier")])  # 128 rows
        seeds = draw_seeds(torch.Generator().manual_seed(3), "cpu") if spec.stochastic_for(operand) else None
        want = _qdq(x, spec, operand, hadamard, False, None, seeds)
        got = compiled._run_compiled(x.to(device), spec, operand, hadamard, False, None,
                                     None if seeds is None else seeds.to(device))
        total += 1
        ok += got is not None and bits_equal(got, want)
    skipped = f"; {len(variants) - total} variants left out after {COMPILE_START_S} s of compiles" \
        if total < len(variants) else ""
    reason = compiled.compiled_quantizers_available()[1]
    line("compiled", f"{ok}/{total} compiled-on-{device.type} results bit-identical to the CPU reference "
         f"(options {compiled._exact_options()}; {time.perf_counter() - t0:.0f} s incl. compiles{skipped})"
         + (f"; {reason}" if reason else ""), "OK" if ok == total else "FAIL")


@guarded
def check_probes(device, smoke: bool) -> None:
    from gpu_check_probes import PROBES

    for name, probe in PROBES.items():
        try:
            figure, status = probe(device)
        except Exception as e:  # noqa: BLE001 - one probe's failure is its line; the others still run
            raise_if_signalled(e)
            figure, status = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", "FAIL"
            traceback.print_exc(file=sys.stderr)
        line(name, figure, status)


# In order of value: bitwise numerics, scaled-mm, the probes, SNIP end to end, then timings.
CHECKS = (check_env, check_bitwise, check_scaled_op, check_scaled_mm, check_gemms, check_probes, check_tiny_snip,
          check_sync_free, check_compiled, check_bandwidth, check_steps)
assert [c.check_name for c in CHECKS] == list(BUDGET_S)


def force_fallback() -> None:
    """Make every scaled-mm call fail, as a torch build that refuses it would (tests the checks)."""
    from megatron_snip.precision.backends import scaled_mm

    def refuse(a, b, **kw):  # kw: out_dtype, fast_accum
        raise RuntimeError("scaled-mm refused on purpose (gpu_check --force-fallback)")

    scaled_mm._mm = refuse
    scaled_mm._SUPPORT.clear()


def count_triton_specializations() -> None:
    """Record each distinct Triton specialization the quantize kernels launch (one compile each on a
    GPU): the constexprs, the dtypes, and Triton's integer specialization (== 1, divisible by 16)."""
    import megatron_snip.precision.quantize.kernel_calls as kq

    launch = kq._launch

    def counted(x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c, spec, elem, *rest, **kw):
        ints = tuple((v == 1, v % 16 == 0) for v in (rows, cols, stride_r, stride_c))
        TRITON_KEYS.add((spec.name, elem.name, x.dtype, y.dtype, seeds is not None, ints, *rest, *sorted(kw.items())))
        return launch(x, y, scalars, seeds, scales_out, rows, cols, stride_r, stride_c, spec, elem, *rest, **kw)

    kq._launch = counted


def budget_table(t0: float, cut: str | None) -> None:
    """The end of every run, cut short or not: one ``budget`` line per check (budget, seconds used,
    status), the totals against the script's limits, and the overall verdict."""
    rows = [("check", "budget_s", "used_s", "status")] + [
        (name, str(budget), f"{SECONDS[name]:.1f}" if name in SECONDS else "-",
         STATUS.get(name, "INFO") if name in SECONDS else "not run") for name, budget in BUDGET_S.items()]
    rows.append(("sum", str(sum(BUDGET_S.values())), f"{sum(SECONDS.values()):.1f}",
                 f"+ {STARTUP_S} s start-up within this script's {PY_LIMIT_S} s; gpu_check.sh <= {SCRIPT_LIMIT_S} s"))
    for name, budget, used, status in rows:
        print(f"{'budget':<12} {name:<10} {budget:>8} {used:>7}  {status}", flush=True)
    if cut:
        line("cut", cut, "FAIL")
    failed = list(dict.fromkeys(FAILED))  # each failing line name once, in order
    line("total", f"{time.perf_counter() - t0:.0f} s, {len(failed)} failed: {failed}", "FAIL" if FAILED else "OK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU, kernels interpreted (tests this script)")
    ap.add_argument("--force-fallback", action="store_true", help="make every scaled-mm fail (the checks must FAIL)")
    ap.add_argument("--budget-scale", type=float, default=None,
                    help="enforce each check's budget times this (default: 1 on a GPU, not enforced with --smoke)")
    names = [c.check_name for c in CHECKS]
    ap.add_argument("--only", default=",".join(names), help=f"comma-separated checks to run, of {names}")
    args = ap.parse_args()
    only = args.only.split(",")
    if set(only) - set(names):
        ap.error(f"--only: unknown check(s) {sorted(set(only) - set(names))}; the checks are {names}")
    if args.budget_scale is not None and not args.budget_scale > 0:
        ap.error(f"--budget-scale: must be > 0, got {args.budget_scale}")
    scale = args.budget_scale if args.budget_scale is not None else (None if args.smoke else 1.0)
    t0 = time.perf_counter()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); use --smoke to test the script on CPU")
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if args.force_fallback:
        force_fallback()
    count_triton_specializations()
    signal.signal(signal.SIGINT, on_sigint)
    try:
        for check in CHECKS:
            if check.check_name in only:
                check(device, args.smoke, budget_s=None if scale is None else BUDGET_S[check.check_name] * scale)
        from torch._dynamo.utils import counters

        from megatron_snip.precision import fallbacks

        for what, reason in fallbacks.recorded().items():
            line("fallback", f"{what}: {reason}"[:300])
        line("compiles", f"{len(TRITON_KEYS)} Triton kernel specializations launched, "
             f"{counters['stats']['unique_graphs']} torch.compile graphs built (each a compile on a cold cache)")
    except KeyboardInterrupt:  # gpu_check.sh's timeout (SIGINT): say where it stopped, then the table
        signal.setitimer(signal.ITIMER_REAL, 0)
        budget_table(t0, f"stopped by SIGINT after {time.perf_counter() - t0:.0f} s, in "
                         f"{CURRENT[0] if CURRENT else 'between checks'}; the lines above are all it reached")
        return 124
    budget_table(t0, None)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
