"""The BF16-evaluation table of results.md: records + ``megatron_snip.evaluate`` JSONs.

    python docs/results/scale_4x_gemm/bf16_eval_table.py RUNS_DIR [RUNS_DIR ...]
    # seeds 1-2: runs/s4g_ckpt; seeds 3-4: runs/s4g_plan runs/s4g_run (protocol.md, "Seeds 3-4")

Every run of a RUNS_DIR's results.jsonl with both evaluations in RUNS_DIR/eval/ (NAME.checkpoint.json,
its final checkpoint in its own plan, which must equal the record bit for bit; NAME.bf16.json, the
same weights in BF16) enters; a (policy, seed) met twice is an error. Then SNIP (run) - tail+switch
and each - BF16, paired by seed, in both evaluations.
"""

import json
import sys
from pathlib import Path

from experiments.comparison.aggregate import paired

DOMAINS = {"val_loss": "valid", "val_loss_moby_dick": "moby_dick", "val_loss_python_docs": "python_docs"}
evals = {}
for runs in map(Path, sys.argv[1:]):
    for line in (runs / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        own_path, bf16_path = (runs / "eval" / f"{rec['name']}.{p}.json" for p in ("checkpoint", "bf16"))
        if rec.get("status") != "ok" or rec["policy"] == "base" or not own_path.is_file():
            continue
        own = json.loads(own_path.read_text())["domains"]
        bf16 = json.loads(bf16_path.read_text())["domains"]
        key = (rec["policy"], rec["seed"])
        if key in evals:
            sys.exit(f"error: {key} is evaluated twice ({runs}); give each run's directory once")
        evals[key] = {"plan": {k: own[d]["loss"] for k, d in DOMAINS.items()},
                      "bf16": {k: bf16[d]["loss"] for k, d in DOMAINS.items()}}
        same = all(own[d]["loss"] == rec["final"][k] for k, d in DOMAINS.items())
        print(f"{runs.name}/{rec['name']}: own plan reproduces the record bit for bit: {same}")


def cells(a: str, b: str, which: str) -> str:
    """``a`` − ``b`` per domain, paired by seed (``experiments.comparison.aggregate.paired``)."""
    out = []
    for k in DOMAINS:
        mean, std, n = paired(*({s: v[which][k] for (p, s), v in evals.items() if p == pol} for pol in (a, b)))
        out.append(f"{mean:+.4f} ± {std / n ** 0.5:.4f} ({n})")
    return " | ".join(out)


print("\n| Δ (mean ± SE, pairs) | evaluated in | training | Moby-Dick | Python docs |\n|---|---|---|---|---|")
for a, b in [("snip", "tail+switch"), ("snip", "bf16"), ("tail+switch", "bf16")]:
    for which, label in [("plan", "the final plan"), ("bf16", "BF16")]:
        print(f"| `{a}` − `{b}` | {label} | {cells(a, b, which)} |")
