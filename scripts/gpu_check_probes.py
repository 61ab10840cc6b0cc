"""gpu_check's one-line probes: questions only a GPU can answer, one line each (``check_probes``).

  scale_pad   does cuBLAS need the 128x128 block scales' K/128 dim padded to a multiple of 4?
              An fp8_block GEMM with K = 1280 (10 blocks) through ``torch._scaled_mm`` with the
              scales unpadded (the stride ``_scaled_mm`` checks) and padded to 12 in storage,
              and through ``torch.nn.functional.scaled_mm`` (v2) padded, each against the exact
              product of its operands (``gemm_error`` within ``accumulation_tolerance``).
              The torch backend sends such GEMMs through the v2 API with padded scales where this
              torch has it (``padded_scale_api``; its own probe checks that call), else to the
              emulated path (``scaled_mm_shape_error``); the line says which of the three calls is
              right, so whether the padding (and the fallback without v2) is needed at all.
  div_rn_ftz  does Triton's ``tl.div_rn`` flush subnormals (results and inputs) under the options
              the quantize kernels launch with (``enable_fp_fusion=False``), and with
              ``enable_reflect_ftz=False``? If it flushes by default, ``launch_qdq`` must pass
              that option (or the project must require a Triton that keeps them).
  stop_flag   does the 4-byte non-blocking copy of the pinned stop flag (``StopSignal.flag_on``)
              read the host flag when the GPU executes it, not when the host queues it? A
              ``torch.cuda._sleep`` keeps the stream busy while the flag is set after queueing.
Each probe returns (figure, status): INFO where the answer is information (scale_pad, div_rn_ftz,
and every probe on CPU), FAIL where a CUDA answer contradicts what the code relies on (stop_flag).
"""

from __future__ import annotations

import torch
from gpu_check_report import raise_if_signalled

PAD_K = 1280  # K/128 = 10: not a multiple of 4 (the 70B qkv dgrad at TP=8 has K = 1280)
SPIN_CYCLES = 1_000_000_000  # torch.cuda._sleep: ~0.5 s of a busy stream on any current GPU


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:90]}"


def probe_scale_padding(device: torch.device) -> tuple[str, str]:
    """fp8_block a (256, 1280) activation x b (384, 1280) weight: which scale layout gives the exact product?"""
    import torch.nn.functional as F

    from megatron_snip.precision.backends.scaled_mm import accumulation_tolerance, gemm_error
    from megatron_snip.precision.formats import Operand
    from megatron_snip.precision.quantize.scaled import dequantize, quantize_scaled

    g = torch.Generator().manual_seed(0)
    m, n, k = 256, 384, PAD_K

    def operand(rows: int) -> torch.Tensor:  # a power-of-two magnitude per (row, 128-block): misplaced scales show
        mag = torch.randint(-2, 3, (rows, k // 128), generator=g).repeat_interleave(128, dim=1).float().exp2()
        return (torch.randn(rows, k, generator=g) * mag).to(device)

    qa = quantize_scaled(operand(m), "fp8_block", Operand.ACTIVATION)
    qb = quantize_scaled(operand(n), "fp8_block", Operand.WEIGHT)
    want_a, want_b, tol = dequantize(qa), dequantize(qb), accumulation_tolerance(k)
    scale_a = qa.scale.t().contiguous().t()  # (M, K/128), outer-dim-major: the 1x128 layout torch checks
    nb, kb = qb.scale.shape
    kp = -(-kb // 4) * 4
    # Both layouts live in buffers of the padded size: a cuBLAS that reads padded rows from the
    # unpadded one reads zeros (a WRONG product), never past an allocation (a sticky CUDA error
    # would end every later check).
    unpadded_store = torch.zeros(nb * kp, device=device)
    unpadded_store[:nb * kb] = qb.scale.reshape(-1)
    padded_store = torch.zeros(nb, kp, device=device)
    padded_store[:, :kb] = qb.scale
    layouts = {"unpadded": unpadded_store[:nb * kb].view(nb, kb).t(),  # (K/128, N/128), strides (1, 10)
               "padded": padded_store[:, :kb].t()}  # strides (1, 12)

    def verdict(call) -> str:
        try:
            err = gemm_error(call(), want_a, want_b)
        except Exception as e:  # noqa: BLE001 - torch's or cuBLAS's refusal, whatever its type
            raise_if_signalled(e)  # a cut, not a refusal
            return f"refused ({_first_line(e)})"
        return f"{'right' if err <= tol else 'WRONG'} (error {err:.1e}, bound {tol:.1e})"

    answers = {f"_scaled_mm {name}": verdict(lambda sb=sb: torch._scaled_mm(
        qa.elements, qb.elements.t(), scale_a, sb, out_dtype=torch.float32)) for name, sb in layouts.items()}
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        answers["scaled_mm v2 padded"] = verdict(lambda: F.scaled_mm(
            qa.elements, qb.elements.t(), scale_a, F.ScalingType.BlockWise1x128, layouts["padded"],
            F.ScalingType.BlockWise128x128, output_dtype=torch.float32))
    else:
        answers["scaled_mm v2"] = "not in this torch"
    right = [name for name, a in answers.items() if a.startswith("right")]
    if "_scaled_mm unpadded" in right:
        answer = "no padding needed: scaled_mm_shape_error's K/128 % 4 rule can go"
    elif right:
        answer = f"padding needed; right with {', '.join(right)}"
    else:
        answer = "no call gave the exact product here (unknown)"
    return (f"fp8_block K={k} ({kb} blocks): " + "; ".join(f"{n_}: {a}" for n_, a in answers.items())
            + f" -> {answer}", "INFO")


def probe_div_rn_ftz(device: torch.device) -> tuple[str, str]:
    """tl.div_rn(2^-120, 2^20) = 2^-140 (subnormal result) and div_rn(2^-140, 0.5) = 2^-139 (subnormal input)."""
    from snip_kernels.probes import div_rn

    x = torch.tensor([2.0**-120, 2.0**-140], device=device)
    y = torch.tensor([2.0**20, 0.5], device=device)
    want = torch.tensor([2.0**-140, 2.0**-139])
    results = {}
    for name, options in (("kernels' options (enable_fp_fusion=False)", {"enable_fp_fusion": False}),
                          ("enable_reflect_ftz=False", {"enable_fp_fusion": False, "enable_reflect_ftz": False})):
        out = torch.full_like(x, float("nan"))
        try:
            div_rn(x, y, out, **options)
        except Exception as e:  # noqa: BLE001 - an option this Triton does not know
            raise_if_signalled(e)  # a cut, not a refusal
            results[name] = f"not accepted ({_first_line(e)})"
            continue
        got = out.cpu()
        results[name] = "keeps subnormals" if torch.equal(got, want) else (
            f"FLUSHES ({got.tolist()} for {want.tolist()})")
    import triton

    figure = f"triton {triton.__version__} on {device.type}: " + "; ".join(f"{k}: {v}" for k, v in results.items())
    first = next(iter(results.values()))
    if first != "keeps subnormals":
        figure += " -> launch_qdq must pass enable_reflect_ftz=False (or require a Triton that keeps them)"
    return figure, "INFO"


def probe_stop_flag(device: torch.device) -> tuple[str, str]:
    """The stop flag copy queued behind a busy stream, the host flag set after queueing: which value lands?"""
    from megatron_snip.training.preemption import StopSignal

    stop = StopSignal()  # not entered: no handlers, only the flag
    float(stop.flag_on(device))  # pins the host flag (an allocation may sync)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda._sleep(SPIN_CYCLES)  # the GPU is busy with an earlier step
    flag = stop.flag_on(device)  # queued behind it while the host flag is 0
    busy = cuda and not torch.cuda.current_stream(device).query()
    stop._flag.fill_(1.0)  # the watcher thread's write, as the signal arrives
    got = float(flag)
    read = "when the GPU executed it" if got == 1.0 else "when the host queued it"
    figure = f"4-byte pinned non-blocking copy on {device.type} read the stop flag {read}"
    if not cuda:
        return figure + " (CPU copies run at once: the answer needs a GPU)", "INFO"
    if not busy:
        return figure + " (inconclusive: the stream had drained before the flag was set; raise SPIN_CYCLES)", "INFO"
    return figure, "OK" if got == 1.0 else "FAIL"


PROBES = {"scale_pad": probe_scale_padding, "div_rn_ftz": probe_div_rn_ftz, "stop_flag": probe_stop_flag}
