"""One device check of the GPU fast path: prints one line per check with its figure.

Run through ``scripts/gpu_check.sh`` (which bounds it to 7 minutes); needs no network.
Checks, in order (``name: figure ... OK|FAIL|INFO``; each says what it exercised):
  env         torch / CUDA / GPU / Triton versions; Transformer Engine and apex presence (TE is
              not checked here: its wheel does not fit the offline image; tests/gpu/test_te_*.py)
  scaled_mm   per format and operand pair: real scaled-mm or emulated, and whether PyTorch documents
              a scaled-mm for it here (``scaled_mm_expected``): a fallback where it does is a FAIL
  gemm_<fmt>  torch-backend GEMMs (fprop/dgrad/wgrad) vs the exact product of their operands, within
              the 14-bit accumulation bound; FAIL on a fallback where scaled-mm is expected
  bitwise     Triton kernels and device-eager quantizers vs the CPU reference on the test input classes
  scaled_op   the float8 elements + scales the torch backend feeds scaled-mm (Triton ``scaled_operand``)
              vs the CPU reference, bitwise
  compiled    torch.compile'd quantizers on the device (eager-numerics options) vs the CPU reference
  copy_bw     device-to-device copy bandwidth (bytes read + written / s)
  kernel_bw   quantize-kernel throughput as a fraction of copy_bw, per format
  step_*      a llama_1b-shaped block stack (synthetic tokens): step times of BF16, torch-backend
              FP8, emulated NVFP4, a mixed per-GEMM FP8/BF16 plan; ratios side by side
  tiny_snip   tiny on this device with SNIP re-planning once: losses finite, plans written
  compiles    Triton kernel specializations launched and torch.compile graphs built (each a cold
              compile on a fresh machine), and the seconds each check took
``--smoke`` runs the checks at toy sizes on CPU (kernels under TRITON_INTERPRET=1; the torch backend
with CPU's reference scaled-mm) to test this script itself; its figures mean nothing.
``--force-fallback`` makes every scaled-mm call fail (to see the checks fail on fallbacks);
``--only a,b`` runs the named checks only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: launch/configs/ (the package comes installed)

FORMATS_Q = ("fp8", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "fp4_block")
FAILED: list[str] = []
SECONDS: dict[str, float] = {}  # check -> wall seconds (cold compiles included)
TRITON_KEYS: set[tuple] = set()  # distinct Triton specializations launched (one compile each on a GPU)
COMPILE_BUDGET_S = 90  # wall seconds the compiled check may spend on cold Inductor compiles


def line(name: str, figure: str, status: str = "INFO") -> None:
    if status == "FAIL":
        FAILED.append(name)
    print(f"{name:<12} {figure} ... {status}", flush=True)


def guarded(fn: Callable[..., None]) -> Callable[..., None]:
    """A check that raises prints one FAIL line with the error instead of ending the run; its time is kept."""
    name = fn.__name__.removeprefix("check_")

    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - report and go on to the next check
            line(name, f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}", "FAIL")
            traceback.print_exc(file=sys.stderr)
        SECONDS[name] = time.perf_counter() - t0
    run.check_name = name
    return run


def bits_equal(a, b) -> bool:
    import torch

    a, b = a.detach().cpu(), b.detach().cpu()
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na].contiguous().view(torch.int32), b[~nb].contiguous().view(torch.int32))


def test_inputs(rows: int, smoke: bool) -> dict:
    """The bit-exactness input classes (kernels/cases.py), (rows, 256); --smoke: three of them at
    (rows, 128) - the interpreter is slow, and tests/unit/test_kernels.py covers every class."""
    from kernels.cases import input_classes

    classes = input_classes(rows, 128 if smoke else 256)
    return {k: v for k, v in classes.items() if k in ("gaussian", "midpoints", "nan_inf")} if smoke else classes


def timed(fn: Callable[[], object], device, reps: int, warmup: int = 2) -> float:
    """Median seconds per call of ``fn`` (CUDA events on a GPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def torch_backend(device):
    """The torch backend as a run on ``device`` builds it; on CPU (--smoke) with CPU's reference scaled-mm."""
    from megatron_snip.precision.backends import get_backend

    return get_backend("torch", cpu_reference=device.type == "cpu")


@guarded
def check_scaled_mm(device, smoke: bool) -> None:
    from megatron_snip.precision.backends.scaled_mm import OPERAND_PAIRS, scaled_mm_expected, scaled_mm_support

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

    t, k, n = (128, 256, 256) if smoke else (4096, 4096, 4096)
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
        figure = (f"error vs exact product of the operands fprop {errs['fprop']:.1e} dgrad {errs['dgrad']:.1e} "
                  f"wgrad {errs['wgrad']:.1e} (bound {max(tols.values()):.1e}); exercised: "
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

    from kernels.cases import input_classes
    from megatron_snip.precision.formats import Operand, get_format
    from megatron_snip.precision.quantize import compiled
    from megatron_snip.precision.quantize.blocks import _qdq
    from megatron_snip.precision.quantize.noise import draw_seeds

    if smoke:
        line("compiled", "skipped in --smoke (CPU compile is tested by tests/unit/test_quantize.py)")
        return
    total = ok = 0
    t0 = time.perf_counter()
    # One compile per (format, operand kind): several input classes stacked by rows (NaN/Inf
    # would poison whole tensors or blocks and hide the rest; the bitwise check covers them).
    # Every format's activation variant first, then the others, until COMPILE_BUDGET_S: each is a
    # cold Inductor compile on a fresh machine, and 18 of them could eat the 7-minute limit.
    variants = [(fmt, operand, hadamard) for operand, hadamard in (
        (Operand.ACTIVATION, False), (Operand.GRADIENT, True), (Operand.WEIGHT, False)) for fmt in FORMATS_Q]
    for fmt, operand, hadamard in variants:
        if time.perf_counter() - t0 > COMPILE_BUDGET_S:
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
    skipped = f"; {len(variants) - total} variants left out after the {COMPILE_BUDGET_S} s budget" \
        if total < len(variants) else ""
    reason = compiled.compiled_quantizers_available()[1]
    line("compiled", f"{ok}/{total} compiled-on-{device.type} results bit-identical to the CPU reference "
         f"(options {compiled._exact_options()}; {time.perf_counter() - t0:.0f} s incl. compiles{skipped})"
         + (f"; {reason}" if reason else ""), "OK" if ok == total else "FAIL")


@guarded
def check_bandwidth(device, smoke: bool) -> None:
    import torch

    from megatron_snip.precision.formats import Operand, get_format
    from megatron_snip.precision.quantize.kernel_calls import qdq, scaled_operand
    from megatron_snip.precision.quantize.noise import draw_seeds

    rows, cols = (128, 128) if smoke else (8192, 8192)
    reps, warmup = (1, 0) if smoke else (10, 2)  # the interpreter is slow; its figures mean nothing
    src = torch.randn(rows * 4, cols, device=device)  # 1 GiB on a GPU
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, reps, warmup)
    copy_bw = 2 * src.numel() * 4 / copy_s
    line("copy_bw", f"{copy_bw / 1e9:.0f} GB/s device-to-device (read + write, {src.numel() * 4 / 2**30:.2f} GiB)")
    x = torch.randn(rows, cols, device=device)
    for fmt in FORMATS_Q:
        spec = get_format(fmt)
        for operand in (Operand.ACTIVATION, Operand.GRADIENT):
            seeds = draw_seeds(None, device) if spec.stochastic_for(operand) else None
            hadamard = spec.wgrad_hadamard and operand is Operand.GRADIENT
            s = timed(lambda spec=spec, operand=operand, hadamard=hadamard, seeds=seeds:
                      qdq(x, spec, operand, hadamard, False, None, seeds), device, reps, warmup)
            frac = 2 * x.numel() * 4 / s / copy_bw
            line("kernel_bw", f"{fmt} {operand.value}{' +RHT' if hadamard else ''}{' +SR' if seeds is not None else ''}: "
                 f"{frac:.0%} of copy bandwidth (fp32 in/out, {x.numel() / s / 1e9:.1f} Gelem/s)",
                 "INFO" if smoke else ("OK" if frac >= 0.7 else "FAIL"))
    xb = x.to(torch.bfloat16)
    for fmt in ("fp8", "fp8_block"):
        spec = get_format(fmt)
        s = timed(lambda spec=spec: scaled_operand(xb, spec, Operand.ACTIVATION, None), device, reps, warmup)
        frac = x.numel() * (2 + 1) / s / copy_bw
        line("kernel_bw", f"{fmt} scaled-mm operand (bf16 in, float8 out): {frac:.0%} of copy bandwidth",
             "INFO" if smoke else ("OK" if frac >= 0.7 else "FAIL"))


def _block_stack(device, smoke: bool):
    import torch

    from megatron_snip.config import load_config
    from megatron_snip.model.llama import LlamaModel

    cfg = load_config(ROOT / "launch/configs/llama_1b.toml", ["model.num_layers=4"] if not smoke else [
        "model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_attention_heads=4",
        "model.num_kv_heads=2"])
    torch.manual_seed(0)
    model = LlamaModel(cfg.model, 32000 if not smoke else 512).to(device)
    return cfg, model


@guarded
def check_steps(device, smoke: bool) -> None:
    import torch

    from megatron_snip.precision.backends import get_backend
    from megatron_snip.precision.backends.scaled_mm import scaled_mm_expected
    from megatron_snip.precision.plan import GEMMS, LINEARS, PrecisionPlan

    _cfg, model = _block_stack(device, smoke)
    b, s = (2, 128) if smoke else (4, 2048)
    vocab = model.vocab_size
    tokens = torch.randint(0, vocab, (b, s + 1), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    numel = {lin: 1 for lin in LINEARS}  # the FP4 share printed nowhere here
    gen = torch.Generator(device=device).manual_seed(1)
    model.set_quant_generator(gen)

    def plan(fmt_of: Callable[[int, str, str], str]) -> PrecisionPlan:
        entries = {g: fmt_of(g.layer, g.linear, g.gemm) for g in model.gemm_ids()}
        return PrecisionPlan.create(entries, step=0, policy="gpu_check", linear_numel=numel)

    mixed = plan(lambda layer, lin, gemm: "fp8" if (layer + LINEARS.index(lin) + GEMMS.index(gemm)) % 2 else "bf16")
    runs = {
        "bf16": ("emulated", plan(lambda *_: "bf16")),
        "fp8 (torch)": ("torch", plan(lambda *_: "fp8")),
        "mixed fp8/bf16 (torch)": ("torch", mixed),
        "nvfp4 (emulated)": ("emulated", plan(lambda *_: "nvfp4")),
    }
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    times = {}
    fp8_expected = scaled_mm_expected("fp8", device)[0]
    for name, (backend, p) in runs.items():
        be = torch_backend(device) if backend == "torch" else get_backend(backend)
        model.set_backend(be)
        model.apply_plan(p)

        def step():
            with autocast:
                loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert math.isfinite(loss.item())

        times[name] = timed(step, device, reps=2 if smoke else 5)
        fb = getattr(be, "fallbacks", {})
        line("step", f"{name}: {times[name] * 1e3:.1f} ms/step ({b}x{s} tokens, {len(model.layers)} llama_1b blocks)"
             + (f"; fallbacks: {'; '.join(f'{k}: {r}' for k, r in fb.items())[:200]}" if fb else ""),
             "FAIL" if fb and fp8_expected else "INFO")  # these plans' fp8 GEMMs must all be scaled-mm ones
    speedup = times["bf16"] / times["fp8 (torch)"]
    line("step_fp8", f"torch FP8 {speedup:.2f}x BF16 (target >= 1.3x)", "INFO" if smoke else (
        "OK" if speedup >= 1.3 else "FAIL"))
    extra = times["mixed fp8/bf16 (torch)"] / times["fp8 (torch)"] - 1
    # Half the GEMMs in BF16: the mixed plan's fair cost is between uniform FP8 and BF16.
    line("step_mixed", f"mixed per-GEMM plan {extra:+.1%} vs uniform FP8 (half its GEMMs BF16; BF16 is "
         f"{times['bf16'] / times['fp8 (torch)'] - 1:+.1%})")
    line("step_nvfp4", f"emulated NVFP4 {times['nvfp4 (emulated)'] / times['bf16']:.2f}x BF16 step time")


@guarded
def check_tiny_snip(device, smoke: bool) -> None:
    from megatron_snip.config import load_config
    from megatron_snip.snip.controller import SnipController
    from megatron_snip.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        over = [f"training.device={device.type}", "precision.backend=torch", "training.max_steps=6",
                "training.eval_interval=1000", "training.eval_batches=1", "training.progress=false",
                "snip.enabled=true", "snip.warmup=3", "snip.interval=1000", "snip.probe_batches=1",
                "snip.noise_draws=1", "data.valid_paths=[]", f"training.run_dir={tmp}/run",
                f"data.cache_dir={tmp}/cache"]
        if smoke:
            over += ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                     "model.num_attention_heads=4", "model.num_kv_heads=2", "training.seq_len=32",
                     "training.micro_batch_size=4", "training.global_batch_size=4", "training.max_steps=4"]
        cfg = load_config(ROOT / "launch/configs/tiny.toml", over)
        t0 = time.perf_counter()
        tr = Trainer(cfg)
        tr.fit([SnipController(cfg, tr)])
        tr.logger.close()
        rows = [json.loads(r) for r in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if "loss" in r]
        plans = sorted(p.name for p in (Path(tmp) / "run" / "plans").glob("step_*.json") if "_stats" not in p.name)
        ok = losses and all(math.isfinite(v) for v in losses) and len(plans) >= 2
        line("tiny_snip", f"{tr.step} steps in {time.perf_counter() - t0:.0f} s, losses {[round(v, 3) for v in losses]}, "
             f"plans {plans}", "OK" if ok else "FAIL")


CHECKS = (check_env, check_scaled_mm, check_gemms, check_bitwise, check_scaled_op, check_compiled, check_bandwidth,
          check_steps, check_tiny_snip)  # most telling first: the 7-minute limit cuts the tail


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU, kernels interpreted (tests this script)")
    ap.add_argument("--force-fallback", action="store_true", help="make every scaled-mm fail (the checks must FAIL)")
    names = [c.check_name for c in CHECKS]
    ap.add_argument("--only", default=",".join(names), help=f"comma-separated checks to run, of {names}")
    args = ap.parse_args()
    only = args.only.split(",")
    if set(only) - set(names):
        ap.error(f"--only: unknown check(s) {sorted(set(only) - set(names))}; the checks are {names}")
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
    t0 = time.perf_counter()
    for check in CHECKS:
        if check.check_name in only:
            check(device, args.smoke)
    from torch._dynamo.utils import counters

    from megatron_snip.precision import fallbacks

    for what, reason in fallbacks.recorded().items():
        line("fallback", f"{what}: {reason}"[:300])
    line("compiles", f"{len(TRITON_KEYS)} Triton kernel specializations launched, "
         f"{counters['stats']['unique_graphs']} torch.compile graphs built (each a compile on a cold cache); seconds "
         "per check: " + ", ".join(f"{k} {v:.0f}" for k, v in SECONDS.items()))
    line("total", f"{time.perf_counter() - t0:.0f} s, {len(FAILED)} failed: {FAILED}", "FAIL" if FAILED else "OK")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
