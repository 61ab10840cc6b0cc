#!/bin/bash
# 6.46M, seeds 1-4, on the bases of ../scale_4x_gemm/: the static `random` rule (not run there), then
# the shipped snip of seed 1 again, which must reproduce its record of commit 18ba018 exactly for
# the new runs to pair with that page's records (../weight_divergence/protocol.md, "Added at 2026-12-05 00:40 UTC").
set -x
# WT: a worktree of commit 67ea6c6 holding corpus/python_docs.jsonl; BASES: the out-dir of
# ../scale_4x_gemm/ holding base_seed1..4 and their records (runs/s4g_plan).
: "${WT:?set WT}" "${BASES:?set BASES}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
COMMON="--base-steps 4000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.8 --rho 0.8 --continuation-schedule wsd --no-sweep --set model.hidden_size=256 --set model.ffn_hidden_size=768 --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 4000 --jobs 2 --threads 1 --timeout 9000"
for d in s4g_random s4g_repro; do
  mkdir -p runs/$d
  for s in 1 2 3 4; do cp -r $BASES/base_seed$s runs/$d/; done
  grep '"policy": "base"' $BASES/results.jsonl >> runs/$d/results.jsonl
done
python3 -m experiments.compare_policies $COMMON --seeds 1,2,3,4 --policies 'random' --out-dir runs/s4g_random --report runs/s4g_random/report.md
python3 -m experiments.compare_policies $COMMON --seeds 1 --policies 'snip' --out-dir runs/s4g_repro --report runs/s4g_repro/report.md
echo ALLDONE
