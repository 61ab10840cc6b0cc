#!/usr/bin/env python
"""Measured linear-GEMM time per format relative to BF16 on this device, in the form of
``precision/capability.GEMM_TIME_RATIO`` (issue #23), so the table can be checked against a real GPU.

    python scripts/gpu_time_ratios.py                 # CUDA device 0, 1B-model layer shapes
    python scripts/gpu_time_ratios.py --smoke         # toy shapes on CPU (tests the script only)

For each of the 1B model's linears (TinyLlama: d=2048, ffn 5632; T = 8 x 2048 tokens) one
``quant_linear`` forward+backward (fprop, dgrad, wgrad) through the ``torch`` backend under BF16
autocast, per format, against the same with format ``bf16``; the ratio is the summed time over
the linears. Formats the backend runs emulated here are marked (``--formats fp8,nvfp4`` on Hopper
measures the emulated GEMM's cost, ``capability.emulated_gemm_time_ratio`` in the table), and the
table's value is printed next to each measurement; the last line gives the measurement as
``snip.time_costs``, which replaces the table. Timing: ``gpu_check_runs.timed`` (CUDA events, median of ``--reps`` after two
warm-up calls). ``scripts/gpu_check.sh`` runs it after the device check.
"""

from __future__ import annotations

import argparse
import sys

import torch
from gpu_check_runs import timed  # scripts/ is on the path: this file runs as a script from there

from megatron_snip.precision import capability
from megatron_snip.precision.backends import get_backend
from megatron_snip.precision.plan import GemmPrecision

# (K, N) of each 1B linear: qkv 2048 -> 2048 + 2*256 (4 KV heads of 64), proj, fc1 (gate+up), fc2.
LINEARS_1B = ((2048, 2560), (2048, 2048), (2048, 11264), (5632, 2048))


def measure(formats: list[str], device: torch.device, tokens: int, shapes, reps: int) -> dict[str, float]:
    """{format: summed fwd+bwd time over ``shapes`` / the same in bf16}."""
    backend = get_backend("torch")
    g = torch.Generator(device=device).manual_seed(0)
    ops = []
    for k, n in shapes:
        x = torch.randn(tokens, k, device=device, generator=g).requires_grad_(True)
        w = torch.nn.Parameter(torch.randn(n, k, device=device, generator=g) / k**0.5)
        ops.append((x, w, torch.randn(tokens, n, device=device, generator=g)))

    def step(fmt: str) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            for x, w, dy in ops:
                x.grad = w.grad = None
                backend.linear(x, w, GemmPrecision.uniform(fmt)).backward(dy)

    times = {f: timed(lambda f=f: step(f), device, reps) for f in ("bf16", *formats)}
    return {f: t / times["bf16"] for f, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp8,fp8_block", help="formats to time against bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="toy shapes on CPU (tests the script, measures nothing)")
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if args.smoke:
        device, tokens, shapes, sm = torch.device("cpu"), 128, ((128, 256), (256, 128)), (9, 0)
    elif not torch.cuda.is_available():
        print("gpu_time_ratios: no CUDA device; use --smoke to test the script on CPU")
        return 2
    else:
        device, tokens, shapes = torch.device("cuda", 0), 8 * 2048, LINEARS_1B
        sm = torch.cuda.get_device_capability(device)
    ratios = measure(formats, device, tokens, shapes, args.reps)
    table = capability.gemm_time_costs("torch", formats, sm)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    print(f"GEMM time per FLOP vs BF16, torch backend, {capability.arch_of(sm)} (sm_{sm[0]}{sm[1]}, {name}), "
          f"1B layer shapes fwd+bwd:")
    for f, r in ratios.items():
        how = "native" if capability.runs_native("torch", f, sm) else "emulated"
        print(f"  {f:<10} measured {r:5.2f}   table {table[f]:.3g} ({how})")
    # The measurement replaces the table (datasheet ratios, and the emulated GEMM's
    # capability.emulated_gemm_time_ratio) for a run, the dry run and solve_plan:
    costs = ", ".join(f'"{f}={r:.3g}"' for f, r in ratios.items())
    print(f"  as a config: --set 'snip.time_costs=[{costs}]'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
