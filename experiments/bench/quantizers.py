"""Quantizer throughput per format and operand kind, eager vs torch.compile, on one linear's operands.

    python -m experiments.bench.quantizers                                 # T,K,N = 4096,1024,1024, all formats
    python -m experiments.bench.quantizers --formats nvfp4 --linear 2048,256,1536 --fwd-bwd

The operands are the six one ``quant_linear`` quantizes for Y = X·Wᵀ (X (T, K), W (N, K),
dY (T, N)), laid out as in training:
  X, W, dY        rowwise (fprop X and W, dgrad dY)
  Wᵀ              a transposed view (dgrad, blocked along N)
  dYᵀ, Xᵀ         transposed views blocked along T (wgrad), with the 16-point RHT where the
                  format uses it (nvfp4)
Throughput = elements / best-of-N wall time (the best run is the least disturbed one on a
shared machine; the median is printed next to it). Compile time is excluded (two warm-up
calls per kernel first). ``--fwd-bwd`` also times one quant_linear forward+backward per
format against the unquantized (bf16-format) path on fp32 tensors.

``--sr-draws`` times, for every stochastically rounded operand (gradients), the compiled quantizer
as shipped (the draws in a kernel of their own where ``compiled.draws_apart`` says so) against one
compiled graph that makes the draws inside the block loop (``blocks._qdq`` with its seeds), in the
same rounds, and checks that both give the same bits: the measurement behind ``draws_apart``.

``python -m experiments.bench.step`` prints the same operands' throughput in one mode after its
training-step ratios (part (3) there).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

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


def linear_operands(fmt: str, t: int, k: int, n: int) -> list[tuple[str, Operand, bool, torch.Tensor]]:
    """The six operands one quant_linear quantizes for Y = X·Wᵀ (X (T, K), W (N, K)), laid out as
    in training: (label, operand kind, Hadamard transform on, tensor)."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g), torch.randn(t, n, generator=g)
    rht = get_format(fmt).wgrad_hadamard
    h = " +RHT" if rht else ""
    return [(f"X {t}x{k}", Operand.ACTIVATION, False, x), (f"W {n}x{k}", Operand.WEIGHT, False, w),
            (f"dY {t}x{n}", Operand.GRADIENT, False, dy), (f"W^T {k}x{n}", Operand.WEIGHT, False, w.t()),
            (f"dY^T {n}x{t}{h}", Operand.GRADIENT, rht, dy.t()), (f"X^T {k}x{t}{h}", Operand.ACTIVATION, rht, x.t())]


def _quantize_call(x: torch.Tensor, fmt: str, operand: Operand, rht: bool, compiled: bool, gen: torch.Generator):
    return lambda: quantize(x, fmt, operand, generator=gen, hadamard=rht, compiled=compiled)


def print_throughput(formats: list[str], t: int, k: int, n: int, reps: int, compiled: bool) -> None:
    """Gelem/s of ``quantize`` per format (rows) and operand (columns) in one mode (best of ``reps``; median)."""
    gen = torch.Generator().manual_seed(1)
    print(f"\n(3) quantize() throughput ({'compiled' if compiled else 'eager'}) on the operands of a {k}->{n} "
          f"linear with {t} tokens, Gelem/s = 1e9 elements/s, best of {reps} (median)")
    names = [name for name, *_ in linear_operands(formats[0], t, k, n)]
    print(f"  {'format':8s}" + "".join(f"{name.split()[0]:>16s}" for name in names))
    for fmt in formats:
        cells = []
        for _, operand, rht, x in linear_operands(fmt, t, k, n):
            best, med = timeit(_quantize_call(x, fmt, operand, rht, compiled, gen), reps)
            cells.append(f"{x.numel() / best / 1e9:7.3f} ({x.numel() / med / 1e9:5.3f})")
        print(f"  {fmt:8s}" + "".join(f"{c:>16s}" for c in cells), flush=True)


def print_eager_vs_compiled(formats: list[str], t: int, k: int, n: int, reps: int, eager_reps: int) -> None:
    """Per format and operand: eager and compiled Gelem/s and the speed-up, then a memcpy for scale."""
    gen = torch.Generator().manual_seed(1)
    print(f"quantize() throughput on the operands of a {k}->{n} linear with {t} tokens (fp32), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; Gelem/s = 1e9 elements/s (best of N; median)")
    print(f"{'format':10s} {'operand':20s} {'eager Gelem/s':>20s} {'compiled Gelem/s':>20s} {'speed-up':>9s}")
    for fmt in formats:
        for name, operand, rht, x in linear_operands(fmt, t, k, n):
            e_best, e_med = timeit(_quantize_call(x, fmt, operand, rht, False, gen), eager_reps)
            c_best, c_med = timeit(_quantize_call(x, fmt, operand, rht, True, gen), reps)
            m = x.numel()
            print(f"{fmt:10s} {name:20s} {m / e_best / 1e9:9.3f} ({m / e_med / 1e9:6.3f}) "
                  f"{m / c_best / 1e9:9.3f} ({m / c_med / 1e9:6.3f}) {e_best / c_best:8.1f}x", flush=True)
    x = torch.randn(t, k)
    c = torch.empty_like(x)
    best, med = timeit(lambda: c.copy_(x), reps)
    print(f"{'(memcpy)':10s} {'copy_ of X':20s} {'':20s} {x.numel() / best / 1e9:9.3f} ({x.numel() / med / 1e9:6.3f})")


def _fused_template(p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """``blocks._qdq`` with its seeds, the draws made inside the one compiled graph (``compiled._specialized`` binds the names)."""
    return _QDQ(p, _SPEC, _OPERAND, _HADAMARD, _COLWISE, None, seeds)  # noqa: F821


def print_sr_draws(formats: list[str], t: int, k: int, n: int, reps: int) -> None:
    """Per stochastically rounded operand: the shipped compiled quantizer vs the draws fused into one graph."""
    from megatron_snip.precision.quantize import blocks, compiled
    from megatron_snip.precision.quantize.noise import draw_seeds

    print(f"\nstochastically rounded operands of a {k}->{n} linear with {t} tokens: compiled as shipped "
          f"(draws apart: compiled.draws_apart) vs the draws fused into the block loop; ms, median of {reps} alternating rounds")
    print(f"{'format':10s} {'operand':20s} {'apart':>6s} {'shipped ms':>11s} {'fused ms':>9s} {'fused/shipped':>14s} bits")
    for fmt in formats:
        spec = get_format(fmt)
        for name, operand, rht, x in linear_operands(fmt, t, k, n):
            if not spec.stochastic_for(operand):
                continue
            colwise = not x.is_contiguous()  # a transposed view: quantize blocks its contiguous base colwise
            p = x.t() if colwise else x
            seeds = draw_seeds(torch.Generator().manual_seed(2), "cpu")
            fused = torch.compile(compiled._specialized(_fused_template, f"fused_{fmt}_{name.split()[0]}", _QDQ=blocks._qdq,
                                                        _SPEC=spec, _OPERAND=operand, _HADAMARD=rht, _COLWISE=colwise),
                                  dynamic=False)
            calls = {"shipped": functools.partial(compiled._run_qdq, p, spec, operand, rht, colwise, None, seeds, True),
                     "fused": functools.partial(fused, p, seeds)}
            same = torch.equal(calls["shipped"](), calls["fused"]())
            times = {c: [] for c in calls}
            for _ in range(2 + reps):
                for c, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    times[c].append(time.perf_counter() - t0)
            shipped, fused_ms = (statistics.median(times[c][2:]) * 1e3 for c in ("shipped", "fused"))
            apart = "yes" if compiled.draws_apart(spec, operand, colwise) else "no"
            print(f"{fmt:10s} {name:20s} {apart:>6s} {shipped:11.2f} {fused_ms:9.2f} {fused_ms / shipped:13.1f}x "
                  f"{'equal' if same else 'DIFFER'}", flush=True)


def print_fwd_bwd(formats: list[str], t: int, k: int, n: int, reps: int) -> None:
    """One quant_linear forward+backward per format (compiled quantizers) vs the unquantized path."""
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


def parse_linear(text: str) -> tuple[int, int, int]:
    """"T,K,N" -> (tokens, in features, out features)."""
    try:
        t, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--linear={text!r} must be T,K,N (three integers), e.g. 4096,1024,1024") from None
    return t, k, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--linear", default="4096,1024,1024", help="T,K,N of the linear whose operands are timed")
    ap.add_argument("--formats", default=",".join(f for f in FORMATS if f != "bf16"))
    ap.add_argument("--reps", type=int, default=10, help="timed calls per compiled measurement")
    ap.add_argument("--eager-reps", type=int, default=3, help="timed calls per eager measurement")
    ap.add_argument("--fwd-bwd", action="store_true", help="also time quant_linear forward+backward per format")
    ap.add_argument("--sr-draws", action="store_true",
                    help="only time the stochastically rounded operands: shipped vs draws fused into one graph")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: torch's default). On a shared, oversubscribed machine "
                         "1 thread gives stable numbers: OpenMP barriers stall when a core is taken")
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    try:
        for f in formats:
            get_format(f)
        t, k, n = parse_linear(args.linear)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sr_draws:
        print_sr_draws(formats, t, k, n, args.reps)
        return 0
    if args.fwd_bwd:  # first: a process that has churned through the big table times GEMMs worse
        print_fwd_bwd(formats, t, k, n, args.reps)
    print_eager_vs_compiled(formats, t, k, n, args.reps, args.eager_reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
