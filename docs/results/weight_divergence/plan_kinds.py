"""Where SNIP's FP8 protection goes: FP8 GEMMs per plan by kind (fprop/dgrad/wgrad) and by block.

    python docs/results/weight_divergence/plan_kinds.py runs/wd_norm runs/wd_sq

Over every plan a SNIP run of OUT_DIR solved (``plans/step_*.json`` but step 0, the initial BF16
plan), all seeds of its results.jsonl; the run directories are not committed (the records are).
"""

import collections
import json
import sys
from pathlib import Path

for out_dir in map(Path, sys.argv[1:]):
    kinds, blocks, plans = collections.Counter(), collections.Counter(), 0
    for line in (out_dir / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["policy"] != "snip" or rec.get("status") != "ok":
            continue
        for path in sorted((out_dir / Path(rec["run_dir"]).name / "plans").glob("step_*[0-9].json")):
            plan = json.loads(path.read_text())
            if plan["step"] == 0:
                continue
            plans += 1
            for key, fmt in plan["entries"].items():
                if fmt == "fp8_block":
                    layer, _, gemm = key.split(".")
                    kinds[gemm] += 1
                    blocks[int(layer)] += 1
    by_kind = ", ".join(f"{g} {kinds[g] / plans:.1f}" for g in ("fprop", "dgrad", "wgrad"))
    by_block = " ".join(f"{blocks[b] / plans:.1f}" for b in sorted(blocks))
    print(f"{out_dir.name}: {plans} plans; FP8 GEMMs per plan: {by_kind}; by block 0..: {by_block}")
