"""protocol.md: shipped ``snip`` with ``snip.forward_depth_prior`` = 1 (``depth1``) and 2 (``depth2``) on the
development bases 11-14 (order 0), split and tabulated by ``../kept_forward/dev.py``'s ``probe`` against
forward_split's shipped ``snip`` and ``tail+switch`` on the same bases.

    python docs/results/depth_prior/dev.py > docs/results/depth_prior/table_dev.md

Reads ``results_dp<p>_plan.jsonl`` and ``evals_dp<p>/`` (``o0_<run>_{checkpoint,bf16,plan}.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "kept_forward"))
from dev import probe  # one probe table for the development probes

ARMS = {"depth1": "dp1", "depth2": "dp2"}  # arm -> out-dir tag

if __name__ == "__main__":
    probe({arm: (HERE / f"results_{tag}_plan.jsonl", HERE / f"evals_{tag}") for arm, tag in ARMS.items()})
