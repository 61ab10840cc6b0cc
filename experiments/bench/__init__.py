"""Benchmarks: what precision emulation and SNIP cost. Each is ``python -m experiments.bench.<name>``
from the repository root; timings depend on the machine, so each output records how it was made.

    step        one training step with every GEMM in one format vs a BF16 step (issue #3), with
                ``--profile`` where the time goes, then quantize() throughput on one linear's
                operands; prints a table (docs/bench/bench_quant*.txt)
    quantizers  quantize() throughput per format and operand, eager vs compiled; ``--fwd-bwd``
                one quant_linear forward+backward
    ilp         CP-SAT on 70B-shaped problems (960 GEMM units, 8 stages): status and solve time
    overheads   the JSON record of a re-plan's cost (statistics + metrics + solve), the step
                ratios of ``step`` and the solve times of ``ilp`` (docs/overheads.json,
                docs/bench/overheads_*.json)

``common`` holds what they share (the trainer they time, uniform plans, the machine record).
"""
