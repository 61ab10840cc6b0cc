"""gpu_check's end-to-end and timing checks: tiny with SNIP, the quantize kernels' bandwidth, step times.

Each is a ``guarded`` check of ``scripts/gpu_check.py`` (its docstring lists them all); the
shapes they run are module constants or functions here, so tests/unit/test_gpu_shapes.py runs
them through the project's rules on CPU.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpu_check_report import guarded, line, report_fallbacks

ROOT = Path(__file__).resolve().parent.parent  # the repository: launch/configs/
FORMATS_Q = ("fp8", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "fp4_block")


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


def torch_backend(device):
    """The torch backend as a run on ``device`` builds it; on CPU (--smoke) with CPU's reference scaled-mm."""
    from megatron_snip.precision.backends import get_backend

    return get_backend("torch", cpu_reference=device.type == "cpu")


KERNEL_BW_GATE = 0.7  # of copy bandwidth, for the bytes the call moves: a memory-bound kernel reaches it


def _bytes_per_elem(fmt: str, numel: int, dtype, rht: bool = False, **kw) -> tuple[int, str]:
    """(bytes the call moves, "12.0 B/elem: kernel 8.0 + amax 4.0"): ``kernel_calls.bytes_moved``,
    its amax pass told apart as the difference with the amax given (the formula has one home)."""
    from megatron_snip.precision.quantize.kernel_calls import bytes_moved

    total = bytes_moved(fmt, numel, dtype, rht, **kw)
    kernel = bytes_moved(fmt, numel, dtype, rht, **kw, amax_given=True)
    amax = f" + amax {(total - kernel) / numel:.1f}" if total > kernel else ""
    return total, f"{total / numel:.1f} B/elem: kernel {kernel / numel:.1f}{amax}"


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
            moved, per = _bytes_per_elem(fmt, x.numel(), x.dtype, hadamard, operand=operand)  # what this call moves
            frac = moved / s / copy_bw
            line("kernel_bw", f"{fmt} {operand.value}{' +RHT' if hadamard else ''}{' +SR' if seeds is not None else ''}: "
                 f"{frac:.0%} of copy bandwidth for the bytes it moves (fp32 in/out, {per}; "
                 f"{x.numel() / s / 1e9:.1f} Gelem/s)", "INFO" if smoke else ("OK" if frac >= KERNEL_BW_GATE else "FAIL"))
    xb = x.to(torch.bfloat16)
    for fmt in ("fp8", "fp8_block"):
        spec = get_format(fmt)
        s = timed(lambda spec=spec: scaled_operand(xb, spec, Operand.ACTIVATION, None), device, reps, warmup)
        moved, per = _bytes_per_elem(fmt, xb.numel(), xb.dtype, operand=Operand.ACTIVATION, scaled=True)
        frac = moved / s / copy_bw
        line("kernel_bw", f"{fmt} scaled-mm operand (bf16 in, float8 out): {frac:.0%} of copy bandwidth for the "
             f"bytes it moves ({per})",
             "INFO" if smoke else ("OK" if frac >= KERNEL_BW_GATE else "FAIL"))


# The step check's model (llama_1b blocks) and batch (micro-batch, sequence); tests/unit/test_gpu_shapes.py
# runs its linears through scaled_mm_shape_error.
STACK_OVERRIDES = {False: ["model.num_layers=4"], True: [
    "model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_attention_heads=4",
    "model.num_kv_heads=2"]}
STACK_BATCH = {False: (4, 2048), True: (2, 128)}


def _block_stack(device, smoke: bool):
    import torch

    from megatron_snip.config import load_config
    from megatron_snip.model.llama import LlamaModel

    cfg = load_config(ROOT / "launch/configs/llama_1b.toml", STACK_OVERRIDES[smoke])
    torch.manual_seed(0)
    model = LlamaModel(cfg.model, 32000 if not smoke else 512).to(device)
    return cfg, model


@guarded
def check_steps(device, smoke: bool) -> None:
    import torch

    from megatron_snip.precision.backends import get_backend
    from megatron_snip.precision.plan import GEMMS, LINEARS, PrecisionPlan

    _cfg, model = _block_stack(device, smoke)
    b, s = STACK_BATCH[smoke]
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
        line("step", f"{name}: {times[name] * 1e3:.1f} ms/step ({b}x{s} tokens, {len(model.layers)} llama_1b blocks)")
        report_fallbacks("step", device, getattr(be, "fallbacks", {}))  # these plans' fp8 GEMMs: all scaled-mm
    speedup = times["bf16"] / times["fp8 (torch)"]
    line("step_fp8", f"torch FP8 {speedup:.2f}x BF16 (target >= 1.3x)", "INFO" if smoke else (
        "OK" if speedup >= 1.3 else "FAIL"))
    extra = times["mixed fp8/bf16 (torch)"] / times["fp8 (torch)"] - 1
    # Half the GEMMs in BF16: the mixed plan's fair cost is between uniform FP8 and BF16.
    line("step_mixed", f"mixed per-GEMM plan {extra:+.1%} vs uniform FP8 (half its GEMMs BF16; BF16 is "
         f"{times['bf16'] / times['fp8 (torch)'] - 1:+.1%})")
    line("step_nvfp4", f"emulated NVFP4 {times['nvfp4 (emulated)'] / times['bf16']:.2f}x BF16 step time")


def tiny_snip_overrides(tmp: str, device, smoke: bool) -> list[str]:
    """tiny_snip's overrides of launch/configs/tiny.toml (tests/unit/test_gpu_shapes.py checks its shapes)."""
    over = [f"training.device={device.type}", "precision.backend=torch", "training.max_steps=6",
            "training.eval_interval=1000", "training.eval_batches=1", "training.progress=false",
            "snip.enabled=true", "snip.warmup=3", "snip.interval=1000", "snip.probe_batches=1",
            "snip.noise_draws=1", "data.valid_paths=[]", f"training.run_dir={tmp}/run",
            f"data.cache_dir={tmp}/cache"]
    if smoke:  # toy sizes; CPU compiles of the quantizers would take minutes (tests/unit covers them)
        over += ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                 "model.num_attention_heads=4", "model.num_kv_heads=2", "training.seq_len=32",
                 "training.micro_batch_size=4", "training.global_batch_size=4", "training.max_steps=4",
                 "precision.compile_quantizers=false"]
    return over


@guarded
def check_tiny_snip(device, smoke: bool) -> None:
    from megatron_snip.config import load_config
    from megatron_snip.snip.controller import SnipController
    from megatron_snip.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        over = tiny_snip_overrides(tmp, device, smoke)
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
        report_fallbacks("tiny_snip", device, getattr(next(iter(tr.model.precision_linears())).backend, "fallbacks", {}))


@guarded
def check_sync_free(device, smoke: bool) -> None:
    """A tiny run's steady-state training steps make no host sync: on CUDA under
    ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing call raises: this check's FAIL
    names it) plus the framework's counter, which also sees pageable host-to-device copies
    (``training/sync_free.py``). BF16 plan, emulated backend, torch's fused AdamW (the skip decided
    on the device). On CPU (``--smoke``) the foreach AdamW reads its skip flag once per step by design."""
    from megatron_snip.config import load_config
    from megatron_snip.training.sync_free import steady_steps
    from megatron_snip.training.trainer import Trainer

    warmup, steps = 2, 3
    with tempfile.TemporaryDirectory() as tmp:
        over = [f"training.device={device.type}", "precision.backend=emulated", "precision.initial_plan=bf16",
                "snip.enabled=false", f"training.max_steps={warmup + steps + 1}", "training.progress=false",
                "data.valid_paths=[]", f"training.run_dir={tmp}/run", f"data.cache_dir={tmp}/cache"]
        if smoke:
            over += ["model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128",
                     "model.num_attention_heads=4", "model.num_kv_heads=2", "training.seq_len=32",
                     "training.micro_batch_size=2", "training.global_batch_size=4"]
        tr = Trainer(load_config(ROOT / "launch/configs/tiny.toml", over))
        for step in range(warmup):  # allocations (device and pinned pools) happen here, and may sync
            tr.train_step(step)
        syncs = steady_steps(tr, warmup, steps)
        allowed = 0 if device.type == "cuda" else steps  # CPU: the foreach AdamW's flag read, once a step
        kinds = {k: syncs.kinds.count(k) for k in dict.fromkeys(syncs.kinds)}
        ok = syncs.count <= allowed and not syncs.of("pageable_copy")
        where = "; at " + ", ".join(syncs.where[:4]) if not ok else ""
        line("sync_free", f"{steps} steady-state steps: {syncs.count} host syncs {kinds or ''} (allowed {allowed}"
             f"{', sync debug mode error' if device.type == 'cuda' else ''}){where}", "OK" if ok else "FAIL")
