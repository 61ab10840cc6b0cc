"""Issue #24 item 1: does compiling the LM head and the loss pay? Eager vs compiled, side by side.

    python -m experiments.bench.head_loss > docs/bench/head_loss.txt

What is timed: one forward and backward of the last stage's tail, logits = h·Wᵀ (the LM head's
GEMM, ``ParallelLMHead``) then ``loss = cross_entropy(logits.float(), targets)`` as
``vocab_parallel_cross_entropy`` computes it without TP, for h (T, D) and W (V, D) in the
training dtype. Three variants of the same function:

* ``eager``     - as the model runs it today;
* ``loss``      - the loss (cast to fp32, log-softmax, gather, mean) through ``torch.compile``,
                  the GEMM eager (as ``training.compile`` keeps every linear eager);
* ``head+loss`` - GEMM and loss in one compiled graph (what torchtitan's loss compile gets when
                  the head is in the compiled model).

Each round times every variant once in a rotating order (the same machine load for all);
reported: median CPU time of a one-thread process per variant and the median over rounds of
(variant / eager). Shapes (``--shapes``): ``tiny``'s tail (8 x 256 tokens, d 256, vocab 320) and a
Llama-vocabulary tail (1024 tokens, d 1024, vocab 32000), in fp32 (the CPU's training dtype;
``--dtypes bfloat16`` adds bf16, whose CPU GEMMs are ~15x slower than fp32 ones here).
The losses and gradients of the variants are compared too (max abs difference), so a variant
that is faster because it computes something else shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from experiments.bench.common import machine
from megatron_snip.model.compiled_regions import compiled, cross_entropy

SHAPES = {"tiny": (2048, 256, 320), "llama_vocab": (1024, 1024, 32000)}  # (T, D, V)


def tail(h_td: torch.Tensor, w_vd: torch.Tensor, t_t: torch.Tensor) -> torch.Tensor:
    """The last stage's tail as the model runs it without TP: mean token cross entropy (fp32)."""
    return cross_entropy(F.linear(h_td, w_vd), t_t)


def variants() -> dict:
    """The three variants; ``loss`` is the graph ``training.compile`` runs (``compiled_regions``)."""
    compiled_loss = compiled(cross_entropy, torch.device("cpu"))
    return {"eager": tail,
            "loss": lambda h, w, t: compiled_loss(F.linear(h, w), t),
            "head+loss": torch.compile(tail, dynamic=False)}


def run_once(fn, h, w, t) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU seconds of one forward + backward, and the loss and gradients it produced."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    start = time.process_time()
    loss = fn(h, w, t)
    loss.backward()
    return time.process_time() - start, loss.detach(), h.grad, w.grad


def bench(name: str, dtype: torch.dtype, rounds: int, warmup: int) -> dict[str, tuple[float, float, list[float]]]:
    """Prints and returns, per variant: median CPU s, median ratio to eager, and the max |difference|
    from eager of (loss, dh, dw)."""
    T, D, V = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.02).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    fns = variants()
    results = {k: run_once(fn, h, w, t) for k, fn in fns.items() for _ in range(warmup)}  # compiles
    times: dict[str, list[float]] = {k: [] for k in fns}
    ratios: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        this_round = {}
        for k in names[r % len(names):] + names[:r % len(names)]:
            results[k] = run_once(fns[k], h, w, t)
            this_round[k] = results[k][0]
        for k in fns:
            times[k].append(this_round[k])
            ratios[k].append(this_round[k] / this_round["eager"])
    _, ref_loss, ref_dh, ref_dw = results["eager"]
    print(f"\n{name} (T {T}, D {D}, V {V}) {str(dtype).removeprefix('torch.')}: median CPU s, median ratio to eager,"
          " max |difference| from eager (loss, dh, dw)")
    out = {}
    for k in fns:
        _, loss, dh, dw = results[k]
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in ((loss, ref_loss), (dh, ref_dh), (dw, ref_dw))]
        out[k] = (statistics.median(times[k]), statistics.median(ratios[k]), diffs)
        print(f"  {k:10s} {out[k][0]:8.4f} s   x{out[k][1]:.3f}   " + "  ".join(f"{d:.1e}" for d in diffs))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="tiny,llama_vocab", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# python -m experiments.bench.head_loss {' '.join(argv)}".rstrip())
    print(f"# machine: {machine()}")
    for name in args.shapes.split(","):
        for dt in args.dtypes.split(","):
            bench(name, getattr(torch, dt), args.rounds, args.warmup)


if __name__ == "__main__":
    main()
