#!/bin/bash
# 6.46M, shipped SNIP and tail at rho = 0.9 on the bases of this folder's study, seeds 1-2 then 3-4
# (../weight_divergence/protocol.md, "Added at 2026-12-05 01:20 UTC"). Resumable: a rerun skips
# the runs its out-dir's results.jsonl holds.
set -x
# WT: a worktree of commit 67ea6c6 holding corpus/python_docs.jsonl; BASES: the out-dir holding
# base_seed1..4 and their records (runs/s4g_plan).
: "${WT:?set WT}" "${BASES:?set BASES}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
COMMON="--base-steps 4000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set model.hidden_size=256 --set model.ffn_hidden_size=768 --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 4000 --jobs 2 --threads 1 --timeout 9000"
d=${OUT:-runs/s4g_rho09}  # OUT: another out-dir on the same bases (the run-budget runs)
EXTRA=${EXTRA:-}  # EXTRA: more compare_policies arguments (--set snip.budget=run)
if [ ! -f $d/results.jsonl ]; then
  mkdir -p $d
  for s in 1 2 3 4; do cp -r $BASES/base_seed$s $d/; done
  grep '"policy": "base"' $BASES/results.jsonl >> $d/results.jsonl
fi
POLICIES=${POLICIES:-snip;tail}  # the first runs; then POLICIES=random, then run_s4g_rho09_rules.sh
python3 -m experiments.compare_policies $COMMON --seeds 1,2 --policies "$POLICIES" $EXTRA --out-dir $d --report $d/report.md
python3 -m experiments.compare_policies $COMMON --seeds 3,4 --policies "$POLICIES" $EXTRA --out-dir $d --report $d/report.md
echo ALLDONE
