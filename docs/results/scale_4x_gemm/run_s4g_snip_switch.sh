#!/bin/bash
# 6.46M, snip+switch against tail+switch, snip and bf16 at rho = 0.9 on new 4000-step bases, seeds
# 1-4 (../weight_divergence/protocol.md, "Added at 2026-12-06 00:48 UTC"), the protocol of
# run_s4g_rho09.sh. Order: snip+switch and tail+switch (seeds 1-2, then 3-4; each call first trains
# its seeds' bases), then snip (plan budget) and bf16 on copies of the same bases.
# Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
# WT: a worktree of commit 11ea84d (every run) holding corpus/python_docs.jsonl.
: "${WT:?set WT}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
COMMON="--base-steps 4000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set model.hidden_size=256 --set model.ffn_hidden_size=768 --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 4000 --jobs 2 --threads 1 --timeout 9000"
R=runs/s4g_sw_run; P=runs/s4g_sw_plan
for seeds in 1,2 3,4; do
  python3 -m experiments.compare_policies $COMMON --seeds $seeds --policies 'snip+switch;tail+switch' --set snip.budget=run --out-dir $R --report $R/report.md
done
mkdir -p $P
for s in 1 2 3 4; do
  [ -d $P/base_seed$s ] || { cp -r $R/base_seed$s $P/; grep '"policy": "base"' $R/results.jsonl | grep "\"name\": \"base_seed$s\"" >> $P/results.jsonl; }
done
python3 -m experiments.compare_policies $COMMON --seeds 1,2,3,4 --policies 'snip' --out-dir $P --report $P/report.md
python3 -m experiments.compare_policies $COMMON --seeds 1,2,3,4 --policies 'bf16' --out-dir $P --report $P/report.md
echo ALLDONE
