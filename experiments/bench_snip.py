"""SNIP overheads: one re-plan (statistics + metrics + solve) on `tiny` as a multiple of one
training step, and CP-SAT solve time up to the 70B shape (80 blocks x 4 linears x 3 GEMMs).

    python scripts/bench_snip.py [--reps 3] [--threads 1] [--no-compiled-quantizers]

A thin front for scripts/bench_overheads.py (its parts (a) and (c)); writes docs/overheads_snip.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_overheads  # noqa: E402 - scripts/ is not a package

if __name__ == "__main__":
    sys.exit(bench_overheads.main(["--skip-emulation", "--out", "docs/overheads_snip.json", *sys.argv[1:]]))
