"""What one FP8 GEMM of the torch backend moves and launches, before and after issue #34 item 2, modelled.

No CPU timing can show a GPU GEMM's cost, so this counts it: it runs the torch backend's own CUDA
call path for each GEMM of a linear - ``kernel_calls.scaled_operand`` for each operand (the Triton
launch stubbed: it counts the bytes of the tensors it reads and writes), then ``scaled_mm._mm`` -
on meta tensors under a dispatch mode that records every aten op (each one a CUDA launch; views
and allocations move nothing and are left out) with the bytes of its inputs and outputs. "before"
replays the design issue #34 found: a 3-pass amax (``x.abs().amax()``) and the tensor scales
computed on the host side in one-element launches, W quantized for fprop and again for dgrad on
every micro-batch, an fp32 M x N output then a cast to bf16. "after" is the code as it is: a
one-pass amax (``torch.aminmax``), the tensor scales derived inside the quantize kernel, the
output in the activation dtype from the
GEMM's epilogue, W quantized once per step (``WeightOperands``: 1 quantization + 1 transpose per
weight and step, shared by the step's m micro-batches, so 1/m of it per GEMM).

Time model (H100 SXM, stated so it can be argued with): each launch takes
max(bytes / HBM, FLOPs / tensor-core peak, a 2 us floor), with HBM 3.35 TB/s x 0.8 achievable,
dense BF16 989 and FP8 1979 TFLOP/s x 0.7 achievable by cuBLAS on large GEMMs (datasheet peaks;
the fractions are typical, not measured here). The BF16 row is the same GEMM on bf16 operands
(the per-step bf16 weight copy amortized like the FP8 weight). No GPU ran any of it: the point is
which design can beat BF16, not the microseconds.

    python -m experiments.bench.fp8_gemm_cost > docs/bench/fp8_gemm_cost.txt
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_snip.precision import scaled_mm_rules
from megatron_snip.precision.backends import scaled_mm
from megatron_snip.precision.formats import E4M3, Operand, get_format
from megatron_snip.precision.quantize import kernel_calls
from megatron_snip.precision.quantize.blocks import _tensor_scales
from megatron_snip.precision.quantize.scaled import ScaledOperand

HBM_BYTES_S = 3.35e12 * 0.8
PEAK_FLOP_S = {"bf16": 989e12 * 0.7, "fp8": 1979e12 * 0.7}
LAUNCH_FLOOR_S = 2e-6


@dataclass
class Launch:
    name: str
    bytes: int
    flops: int = 0
    share: float = 1.0  # the fraction of this launch one micro-batch's GEMM pays (1/m: once per step)

    def seconds(self, peak: float) -> float:
        return self.share * max(self.bytes / HBM_BYTES_S, self.flops / peak if self.flops else 0.0, LAUNCH_FLOOR_S)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Traffic(TorchDispatchMode):
    """Every aten op that moves data (not a view, not an allocation) with its input + output bytes."""

    SKIP = frozenset({"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[Launch] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if not func.is_view and name not in self.SKIP:
            moved = sum(_nbytes(t) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
            flops = 0
            if name in ("aten._scaled_mm", "aten._scaled_mm_v2", "aten.mm"):
                (m, k), n = args[0].shape, args[1].shape[1]
                flops = 2 * m * k * n
            self.launches.append(Launch(name, moved, flops))
        return out


@contextlib.contextmanager
def _stubbed_kernel(mode: _Traffic) -> Iterator[None]:
    """kernel_calls' Triton launch as one recorded launch reading x and writing y and the scales."""
    real = kernel_calls.launch_qdq

    def launch(x, y, scalars, seeds, scales_out, *args, **kw):
        mode.launches.append(Launch("triton quantize", _nbytes(x) + _nbytes(y) + _nbytes(scales_out)))

    kernel_calls.launch_qdq = launch
    try:
        yield
    finally:
        kernel_calls.launch_qdq = real


def _old_amax_and_scales(x: torch.Tensor) -> torch.Tensor:
    """The host side of a tensor-scaled operand as issue #34 found it: a 3-pass amax, then the
    scales' arithmetic and the scalars' copies as one-element launches (the kernel now derives them)."""
    amax = x.abs().amax().float()
    scalars = torch.zeros(4, dtype=torch.float32, device=x.device)
    scalars[0], scalars[1] = _tensor_scales(amax, E4M3)
    return amax


@contextlib.contextmanager
def _old_amax() -> Iterator[None]:
    real = kernel_calls.tensor_amax
    kernel_calls.tensor_amax = _old_amax_and_scales
    try:
        yield
    finally:
        kernel_calls.tensor_amax = real


def _operand(x: torch.Tensor, fmt: str, kind: Operand) -> ScaledOperand:
    return ScaledOperand(*kernel_calls.scaled_operand(x, get_format(fmt), kind, None))


def _gemm_launches(gemm: str, fmt: str, t: int, n: int, k: int, m: int, after: bool) -> list[Launch]:
    """The launches of one GEMM of a linear with weight (n, k) on t tokens, per micro-batch (m per step)."""
    meta = {"device": "meta"}
    x, w = torch.empty(t, k, dtype=torch.bfloat16, **meta), torch.empty(n, k, **meta)
    dy = torch.empty(t, n, dtype=torch.bfloat16, **meta)
    mode = _Traffic()
    out_dtype = torch.float32 if gemm == "wgrad" or not after else torch.bfloat16
    with mode, _stubbed_kernel(mode), (contextlib.nullcontext() if after else _old_amax()):
        if gemm == "wgrad":
            qa, qb = _operand(dy.t(), fmt, Operand.GRADIENT), _operand(x.t(), fmt, Operand.ACTIVATION)
        else:
            a, kind = (x, Operand.ACTIVATION) if gemm == "fprop" else (dy, Operand.GRADIENT)
            qa = _operand(a, fmt, kind)
            b = w if gemm == "fprop" else w.t()
            if after:  # W once per step: fprop quantizes it, dgrad transposes fprop's codes (1/m each)
                start = len(mode.launches)
                qw = _operand(w, fmt, Operand.WEIGHT)
                if gemm == "dgrad":
                    del mode.launches[start:]  # fprop's quantization is fprop's
                    from megatron_snip.precision.backends.weight_operands import _transposed

                    qw = _transposed(qw)
                for launch in mode.launches[start:]:
                    launch.share = 1.0 / m
                    launch.name += f" (W, 1/{m})"
                qb = qw
            else:
                qb = _operand(b, fmt, Operand.WEIGHT)
        y = scaled_mm._mm(qa, qb, out_dtype=out_dtype, fast_accum=after and scaled_mm.fast_accum_for(
            fmt, *scaled_mm_rules.OPERAND_PAIRS[("fprop", "dgrad", "wgrad").index(gemm)]))
        if gemm != "wgrad" and not after:
            y.to(torch.bfloat16)  # the cast of the fp32 output
    return mode.launches


def _bf16_launches(gemm: str, t: int, n: int, k: int, m: int) -> list[Launch]:
    shapes = {"fprop": (t, k, n), "dgrad": (t, n, k), "wgrad": (n, t, k)}[gemm]
    mm, kk, nn = shapes
    launches = [Launch("aten.mm (bf16)", 2 * (mm * kk + kk * nn + mm * nn) + (2 * mm * nn if gemm == "wgrad" else 0),
                       2 * mm * kk * nn)]
    if gemm == "fprop":  # the step's bf16 weight copy (WeightCopy), read 4 + write 2 per element, 1/m
        launches.append(Launch(f"weight copy (1/{m})", 6 * n * k, share=1.0 / m))
    return launches


def _summary(launches: list[Launch], peak: float) -> tuple[float, float, float, float]:
    """Per micro-batch: (launches, MB moved, modelled ms, launches under 1 MB that are not GEMMs), each
    once-per-step launch counted as 1/m of one."""
    small = sum(x.share for x in launches if x.bytes < 1 << 20 and not x.flops)
    return (sum(x.share for x in launches), sum(x.share * x.bytes for x in launches) / 1e6,
            sum(x.seconds(peak) for x in launches) * 1e3, small)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 2048, help="tokens per micro-batch (llama_1b: 8 x 2048)")
    ap.add_argument("--n", type=int, default=2 * 5632, help="fc1's out features (gate + up)")
    ap.add_argument("--k", type=int, default=2048, help="fc1's in features")
    ap.add_argument("--micro-batches", type=int, default=8, help="per step (llama_1b: 512 / (8 x DP 8))")
    ap.add_argument("--formats", default="fp8,fp8_block")
    ap.add_argument("--detail", action="store_true", help="list every launch")
    args = ap.parse_args(argv)
    t, n, k, m = args.tokens, args.n, args.k, args.micro_batches
    print(f"llama_1b fc1 on H100 (modelled): W {n} x {k}, {t} tokens per micro-batch, {m} micro-batches per "
          f"step; bf16 activations and gradients, fp32 master weights\n")
    header = f"{'GEMM':<6} {'format':<10} {'design':<7} {'launches':>8} {'of them <1MB':>12} {'MB moved':>9} " \
             f"{'model ms':>9} {'vs BF16':>8}"
    print(header)
    print("-" * len(header))
    totals: dict[tuple[str, str], float] = {}
    for gemm in ("fprop", "dgrad", "wgrad"):
        bl, bmb, bms, bsmall = _summary(_bf16_launches(gemm, t, n, k, m), PEAK_FLOP_S["bf16"])
        print(f"{gemm:<6} {'bf16':<10} {'':<7} {bl:>8.1f} {bsmall:>12.1f} {bmb:>9.0f} {bms:>9.3f} {1.0:>7.2f}x")
        totals[("bf16", "")] = totals.get(("bf16", ""), 0.0) + bms
        for fmt in args.formats.split(","):
            for after in (False, True):
                launches = _gemm_launches(gemm, fmt, t, n, k, m, after)
                nl, mb, ms, small = _summary(launches, PEAK_FLOP_S["fp8"])
                design = "after" if after else "before"
                totals[(fmt, design)] = totals.get((fmt, design), 0.0) + ms
                print(f"{gemm:<6} {fmt:<10} {design:<7} {nl:>8.1f} {small:>12.1f} {mb:>9.0f} {ms:>9.3f} "
                      f"{ms / bms:>7.2f}x")
                if args.detail:
                    for x in launches:
                        print(f"{'':<8}{x.name:<48} {x.share * x.bytes / 1e6:>10.2f} MB "
                              f"{x.seconds(PEAK_FLOP_S['fp8']) * 1e3:>8.3f} ms")
    print()
    base = totals[("bf16", "")]
    for (fmt, design), ms in totals.items():
        print(f"fprop+dgrad+wgrad {fmt:<10} {design:<7} {ms:7.3f} ms  ({ms / base:.2f}x BF16)")


if __name__ == "__main__":
    main()

