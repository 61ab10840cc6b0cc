"""Golden FP4-share plans: the cases ``test_plan_golden.py`` replays against ``data/fp4_share_plans.json``.

The file was written by this module (``python -m tests.unit.plan_golden``) with the code before
the GEMM-time target existed (issue #23), so the test shows that every FP4-share plan - the static
policies with and without ``fair_share``, and the ILP policies on seeded synthetic costs, at both
granularities, with and without pipeline stages - keeps its entries, hash, objective and share.
Regenerate it only for a deliberate change of the plans, and say so in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from megatron_snip.model import shapes as model_shapes
from megatron_snip.parallel.topology import stage_of_layer
from megatron_snip.precision.plan import all_gemm_ids
from megatron_snip.snip.policies import PlanContext, make_plan

GOLDEN = Path(__file__).parent / "data" / "fp4_share_plans.json"
NUM_LAYERS = 8
NUMEL = model_shapes.linear_numel(model_shapes.linear_shapes(128, 384, 4, 2))
FORMAT_SETS = (("fp8", "nvfp4"), ("fp8_block", "fp4_block"), ("fp8", "mxfp4"))
STATIC = ("bf16", "uniform:fp8", "uniform:nvfp4", "bf16_ends", "bf16_ends:2,2", "layer_type",
          "layer_type:fc2", "random")
ILP = ("snip", "min_rel_err")


def _costs(formats: tuple[str, ...], seed: int) -> dict:
    """Seeded synthetic per-GEMM costs: FP4 formats cost more than the high-precision one."""
    rng = np.random.default_rng(seed)
    return {g: {f: float(rng.random() * (3.0 if f.startswith(("nv", "mx", "fp4")) else 1.0)) for f in formats}
            for g in all_gemm_ids(NUM_LAYERS)}


def cases():
    """(name, spec, PlanContext, costs or None) for every golden plan."""
    for formats in FORMAT_SETS:
        for rho in (0.5, 0.75, 0.9):
            for granularity in ("layer", "gemm"):
                for pp in (1, 2):
                    for fair in (False, True):
                        ctx = PlanContext(num_layers=NUM_LAYERS, linear_numel=NUMEL, formats=formats, fp4_target=rho,
                                          granularity=granularity, stage_of_layer=stage_of_layer(NUM_LAYERS, pp),
                                          seed=3, step=7, fair_share=fair)
                        tag = f"{','.join(formats)}@{rho}/{granularity}/pp{pp}/fair{int(fair)}"
                        for spec in STATIC:
                            yield f"{spec}|{tag}", spec, ctx, None
                        if fair:
                            continue  # the ILP ignores fair_share
                        for spec in ILP:
                            yield f"{spec}|{tag}", spec, ctx, _costs(formats, seed=int(rho * 100) + pp)


def summary(plan) -> dict:
    """What must not change: entries (through the hash), share, objective, status, non-timing extras."""
    extra = {k: v for k, v in plan.extra if k not in ("solve_time_s", "deterministic_time", "solver_bound")}
    return {"hash": plan.hash, "fp4_flops_share": plan.fp4_flops_share, "objective": plan.objective,
            "solver_status": plan.solver_status, "extra": extra}


def compute() -> dict:
    return {name: summary(make_plan(spec, ctx, costs)) for name, spec, ctx, costs in cases()}


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(compute(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
