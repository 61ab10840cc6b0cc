"""Benchmark the SNIP ILP (CP-SAT, one worker) on 70B-shaped instances.

Llama-70B block shapes (d=8192, ffn 28672, 64 heads, 8 KV heads, head_dim 128),
4 candidate formats (bf16, fp8, mxfp4, nvfp4), rho = 0.75 globally and on each of 8
pipeline stages, seeded random positive costs. Reports, per granularity and model
depth, the solver status, solver wall time, end-to-end time (model build + solve),
deterministic time and whether repeated solves give the identical assignment.
Target: the 80-layer instance (960 GEMM units) proven OPTIMAL in < 1 s.

    python -m experiments.bench.ilp                      # random costs, 8/16/32/80 layers
    python -m experiments.bench.ilp --costs structured   # costs rise as precision drops

``python -m experiments.bench.overheads`` records the same instances (random costs, one solve
each) in its JSON.

Columns: solve_s = CP-SAT wall time, e2e_s = build_problem + solve, det_t = CP-SAT
deterministic time, gap = (objective - solver bound) / objective, where the objective is
re-evaluated in float costs and the bound comes from the integer-scaled costs, so
|gap| ~ 1e-6 is cost-rounding noise; same = identical assignment in every repeat.

Cost models:
  random      cost[g][f] ~ LogNormal(0, 1) independently per GEMM and format (no
              structure, so no format dominates another - the harder case).
  structured  bf16 0, fp8 ~ 0.05*s, nvfp4 ~ s, mxfp4 ~ 2*s with s ~ LogNormal(0, 1) per
              GEMM and 20% multiplicative noise - shaped like SNIP divergences.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_snip.model import shapes as model_shapes
from megatron_snip.precision.plan import GemmId, all_gemm_ids
from megatron_snip.snip import ilp

FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")


def llama70b_numel() -> dict[str, int]:
    """Weight elements per linear of one Llama-2-70B block (d=8192, ffn 28672, 64 heads / 8 KV, head_dim 128)."""
    return model_shapes.linear_numel(model_shapes.linear_shapes(8192, 28672, 64, 8, 128))


def make_costs(num_layers: int, kind: str, seed: int) -> dict[GemmId, dict[str, float]]:
    rng = np.random.default_rng(seed)
    gids = all_gemm_ids(num_layers)
    if kind == "random":
        c = rng.lognormal(0.0, 1.0, size=(len(gids), len(FORMATS)))
    else:
        scale = rng.lognormal(0.0, 1.0, size=(len(gids), 1))
        base = np.array([0.0, 0.05, 2.0, 1.0])  # bf16, fp8, mxfp4, nvfp4
        c = scale * base * rng.lognormal(0.0, 0.2, size=(len(gids), len(FORMATS)))
    return {g: dict(zip(FORMATS, map(float, row))) for g, row in zip(gids, c)}


def solve_instance(num_layers: int, granularity: str, kind: str, *, seed: int = 0, rho: float = 0.75,
                   stages: int = 8, repeats: int = 1, max_time: float = 10.0) -> dict:
    """Build and solve one 70B-shaped instance ``repeats`` times with ``stages`` (capped at the depth)
    pipeline stages evenly split; medians of the solver wall time and of build + solve.

    Returns {"problem", "solutions" (one per repeat), "stages", "solve_s", "e2e_s"}."""
    stages = min(stages, num_layers)
    stage_of_layer = {layer: layer * stages // num_layers for layer in range(num_layers)}
    costs = make_costs(num_layers, kind, seed)
    numel = llama70b_numel()
    solve_s, e2e_s, sols = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        problem = ilp.build_problem(costs, numel, FORMATS, rho, granularity, stage_of_layer)
        sol = ilp.solve(problem, max_deterministic_time=max_time)
        e2e_s.append(time.perf_counter() - t0)
        solve_s.append(sol.solve_time_s)
        sols.append(sol)
    return {"problem": problem, "solutions": sols, "stages": stages, "solve_s": float(np.median(solve_s)),
            "e2e_s": float(np.median(e2e_s))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,16,32,80", help="comma-separated model depths")
    ap.add_argument("--stages", type=int, default=8, help="pipeline stages (capped at the depth)")
    ap.add_argument("--rho", type=float, default=0.75)
    ap.add_argument("--costs", choices=("random", "structured"), default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="solves per instance (timing = median)")
    ap.add_argument("--max-deterministic-time", type=float, default=10.0)
    args = ap.parse_args()

    depths = [int(x) for x in args.layers.split(",")]
    print(f"CP-SAT 1 worker, linearization_level=2, seed 0; formats {FORMATS}; rho={args.rho}; "
          f"costs={args.costs} (seed {args.seed}); median of {args.repeats} solves")
    print(f"{'gran':>5} {'layers':>6} {'units':>5} {'stages':>6} {'status':>8} {'solve_s':>8} {'e2e_s':>7} "
          f"{'det_t':>7} {'min_stage_fp4':>13} {'gap':>9} {'same':>5}")
    verdict = []
    for granularity in ("gemm", "layer"):
        for num_layers in depths:
            r = solve_instance(num_layers, granularity, args.costs, seed=args.seed, rho=args.rho, stages=args.stages,
                               repeats=args.repeats, max_time=args.max_deterministic_time)
            problem, sols, stages = r["problem"], r["solutions"], r["stages"]
            sol = sols[0]
            same = all(s.assignment == sol.assignment for s in sols)
            gap = (sol.objective - sol.bound) / max(abs(sol.objective), 1e-12) if sol.ok else float("nan")
            print(f"{granularity:>5} {num_layers:>6} {len(problem.units):>5} {stages:>6} {sol.status:>8} "
                  f"{r['solve_s']:>8.3f} {r['e2e_s']:>7.3f} {sol.deterministic_time:>7.3f} "
                  f"{min(sol.per_stage_share.values()) if sol.ok else float('nan'):>13.4f} {gap:>9.2e} {same!s:>5}")
            if num_layers == 80:
                ok = sol.status == "OPTIMAL" and r["solve_s"] < 1.0
                verdict.append(f"{granularity}: {'PASS' if ok else 'FAIL'} (80 layers, {sol.status}, "
                               f"{r['solve_s']:.3f} s solver wall)")
    if verdict:
        print("target (80 layers proven optimal in < 1 s):", "; ".join(verdict))


if __name__ == "__main__":
    main()
