#!/usr/bin/env bash
# One device check of the GPU fast path, in order of value (bitwise numerics, scaled-mm, the one-line
# probes, SNIP on tiny, then timings): one line per check with its figure, exit 0 iff all pass. A
# fallback where the device should run the fast path is a FAIL. Needs no network. At most 6 minutes by
# design: each check has a budget (scripts/gpu_check.py BUDGET_S, cut with a FAIL line past it), the
# checks get 330 s + 5 s to exit, the GEMM-time ratios 22 s + 3 s; a run cut short prints every line it
# reached and the budget table. Usage: scripts/gpu_check.sh [--smoke] [--force-fallback] [--only a,b]
#   --smoke: toy sizes on CPU (Triton interpreter) to test the script itself; budgets not enforced
#            (on a busy CPU the whole smoke run takes longer than the bound);
#   --force-fallback: every scaled-mm refused (the scaled-mm checks must FAIL); --only: a subset.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # every line out as it is printed, also when the output is a pipe or a file
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_gpu_check}"
export WANDB_MODE=disabled
smoke=0
case " $* " in *" --smoke "*) smoke=1 ;; esac
if [ "$smoke" -eq 1 ]; then
  python3 scripts/gpu_check.py "$@"  # CPU: unbounded (the interpreter is slow), tests the code paths
  rc=$?
  python3 scripts/gpu_time_ratios.py --smoke --reps 1  # its code path too (informational)
  exit "$rc"
fi
timeout --signal=INT --kill-after=5 330 python3 scripts/gpu_check.py "$@"
rc=$?
[ "$rc" -eq 124 ] && echo "gpu_check: stopped at its 330 s limit (the lines above are all it reached)"
# The measured GEMM-time ratios next to capability.GEMM_TIME_RATIO (SNIP's gemm_time target);
# informational (it does not change the exit status), in the last 25 s of the 6 minutes.
timeout --signal=INT --kill-after=3 22 python3 scripts/gpu_time_ratios.py --reps 10
exit "$rc"
