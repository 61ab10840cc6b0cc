"""Quantizer throughput per format and operand kind, eager vs torch.compile.

    python scripts/bench_quantizers.py                 # (4096, 1024) fp32, all formats
    python scripts/bench_quantizers.py --formats nvfp4 --linear 4096,1024,1024

Rows are the operand kinds one linear layer quantizes:
  activation / weight / gradient   rowwise (fprop X, W; dgrad dY)
  weight^T                         a transposed view (dgrad Wᵀ, blocked along N)
  gradient^T / activation^T        transposed views blocked along T (wgrad dYᵀ, Xᵀ),
                                   with the 16-point RHT where the format uses it (nvfp4)
Throughput = elements / best-of-N wall time (this machine is shared; the best
run is the least disturbed one; the median is printed too). Compile time is
excluded (two warm-up calls per kernel first).

``--linear T,K,N`` also times one quant_linear forward+backward per format
against the unquantized (bf16-format) path on fp32 tensors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_snip.precision.formats import FORMATS, Operand, get_format
from megatron_snip.precision.gemm import quant_linear
from megatron_snip.precision.gemm_shapes import gemm_shape_error
from megatron_snip.precision.plan import GEMMS, GemmPrecision
from megatron_snip.precision.quantize import quantize


def timeit(fn, reps: int) -> tuple[float, float]:
    """(best, median) seconds over ``reps`` calls after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def operand_cases(fmt: str, rows: int, cols: int) -> list[tuple[str, Operand, bool, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g)
    xt = torch.randn(cols, rows, generator=g).t()  # (rows, cols) view of a transposed buffer
    rht = get_format(fmt).wgrad_hadamard
    return [
        ("activation", Operand.ACTIVATION, False, x),
        ("weight", Operand.WEIGHT, False, x),
        ("weight^T", Operand.WEIGHT, False, xt),
        ("gradient", Operand.GRADIENT, False, x),
        ("gradient^T" + (" +RHT" if rht else ""), Operand.GRADIENT, rht, xt),
        ("activation^T" + (" +RHT" if rht else ""), Operand.ACTIVATION, rht, xt),
    ]


def bench_quantizers(formats: list[str], rows: int, cols: int, reps: int, eager_reps: int) -> None:
    n = rows * cols
    print(f"quantize() throughput on a ({rows}, {cols}) fp32 operand, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; Gelem/s = 1e9 elements/s (best of N; median)")
    print(f"{'format':10s} {'operand':20s} {'eager Gelem/s':>20s} {'compiled Gelem/s':>20s} {'speed-up':>9s}")
    gen = torch.Generator().manual_seed(1)
    for fmt in formats:
        for name, operand, rht, x in operand_cases(fmt, rows, cols):
            def run(compiled: bool, x=x, fmt=fmt, operand=operand, rht=rht) -> None:
                quantize(x, fmt, operand, generator=gen, hadamard=rht, compiled=compiled)

            e_best, e_med = timeit(lambda: run(False), eager_reps)
            c_best, c_med = timeit(lambda: run(True), reps)
            print(f"{fmt:10s} {name:20s} {n / e_best / 1e9:9.3f} ({n / e_med / 1e9:6.3f}) "
                  f"{n / c_best / 1e9:9.3f} ({n / c_med / 1e9:6.3f}) {e_best / c_best:8.1f}x", flush=True)
    c = torch.empty_like(x)
    best, med = timeit(lambda: c.copy_(x), reps)
    print(f"{'(memcpy)':10s} {'copy_ of the operand':20s} {'':20s} {n / best / 1e9:9.3f} ({n / med / 1e9:6.3f})")


def bench_linear(formats: list[str], t: int, k: int, n: int, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=g, requires_grad=True)
    w = torch.randn(n, k, generator=g).div_(k**0.5).requires_grad_(True)
    dy = torch.randn(t, n, generator=g)

    def step(precision: GemmPrecision, compiled: bool) -> None:
        x.grad = w.grad = None
        y = quant_linear(x, w, precision, generator=g, compiled=compiled)
        y.backward(dy)

    base, base_med = timeit(lambda: step(GemmPrecision(), False), reps)
    print(f"quant_linear forward+backward, T={t} K={k} N={n}, fp32 (best of {reps}; median)")
    print(f"{'formats':10s} {'ms':>16s} {'vs unquantized':>15s}")
    print(f"{'bf16':10s} {base * 1e3:7.1f} ({base_med * 1e3:6.1f}) {1.0:14.2f}x")
    for fmt in formats:
        if any(gemm_shape_error(fmt, gemm, n, k, t) for gemm in GEMMS):
            print(f"{fmt:10s} {'n/a':>16s}   (shape not a multiple of its blocks)")
            continue
        best, med = timeit(lambda fmt=fmt: step(GemmPrecision.uniform(fmt), True), reps)
        print(f"{fmt:10s} {best * 1e3:7.1f} ({med * 1e3:6.1f}) {best / base:14.2f}x", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096,1024", help="rows,cols of the operand (default 4096,1024)")
    ap.add_argument("--formats", default=",".join(f for f in FORMATS if f != "bf16"))
    ap.add_argument("--reps", type=int, default=10, help="timed calls per compiled measurement")
    ap.add_argument("--eager-reps", type=int, default=3, help="timed calls per eager measurement")
    ap.add_argument("--linear", default="", help="T,K,N: also time quant_linear forward+backward")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: torch's default). On a shared, oversubscribed machine "
                         "1 thread gives stable numbers: OpenMP barriers stall when a core is taken")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        get_format(f)
    rows, cols = (int(v) for v in args.shape.split(","))
    if args.linear:  # first: a process that has churned through the big table times GEMMs worse
        t, k, n = (int(v) for v in args.linear.split(","))
        bench_linear(formats, t, k, n, args.reps)
    bench_quantizers(formats, rows, cols, args.reps, args.eager_reps)


if __name__ == "__main__":
    main()
