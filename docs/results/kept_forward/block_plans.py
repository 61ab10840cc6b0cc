"""Write, for one run, its last plan cut to one block's forward GEMMs (protocol_blocks.md): ``block_<b>.json``
holds the last plan's format for every fprop of block b and BF16 for every other GEMM, so evaluating the
run's final checkpoint in it prices that block's FP4/FP8 forward GEMMs alone.

    python docs/results/kept_forward/block_plans.py RUN_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_snip.config import load_config
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.precision.plan import PrecisionPlan


def main(run: Path, out: Path) -> None:
    cfg = load_config(str(run / "config.toml"))
    numel = linear_numel(model_linear_shapes(cfg.model))
    last = PrecisionPlan.load(max((run / "plans").glob("step_??????.json")))
    out.mkdir(parents=True, exist_ok=True)
    for b in range(cfg.model.num_layers):
        entries = {g: (f if g.layer == b and g.gemm == "fprop" else "bf16") for g, f in last.entries}
        plan = PrecisionPlan.create(entries, numel, step=last.step, policy=f"{last.policy} block {b} fprop")
        (out / f"block_{b}.json").write_text(plan.to_json())


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
