#!/usr/bin/env bash
# One device check of the GPU fast path (kernels, compiled quantizers, torch-backend FP8 GEMMs,
# bandwidth, step times, SNIP on tiny): one line per check with its figure, exit 0 iff all pass.
# A fallback where PyTorch documents a scaled-mm for the device is a FAIL. Needs no network; bounded
# to 7 minutes. Usage: scripts/gpu_check.sh [--smoke] [--force-fallback] [--only check,check]
#   --smoke: toy sizes on CPU (Triton interpreter) to test the script itself (on a busy CPU the whole
#            smoke run takes longer than the bound: run scripts/gpu_check.py --smoke directly);
#   --force-fallback: every scaled-mm refused (the scaled-mm checks must FAIL); --only: a subset.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_gpu_check}"
export WANDB_MODE=disabled
timeout --signal=INT --kill-after=10 390 python3 scripts/gpu_check.py "$@"
rc=$?
[ "$rc" -eq 124 ] && echo "gpu_check: stopped at its 6.5-minute limit"
# The measured GEMM-time ratios next to capability.GEMM_TIME_RATIO (SNIP's gemm_time target); on a
# GPU only, informational (it does not change the exit status), within the last 30 s of the bound.
case " $* " in *" --smoke "*) ;; *) timeout --signal=INT 30 python3 scripts/gpu_time_ratios.py --reps 10 ;; esac
exit "$rc"
