#!/bin/bash
# 1.66M at rho = 0.9: every policy of the per-GEMM study (gemm_results.md) on new bases, seeds 1-2
# then 3-4 (../weight_divergence/protocol.md, "Added at 2026-12-05 05:55 UTC"). Starts after the
# 6.46M runs at 0.9 (one machine, two jobs). Resumable: a rerun skips the runs an out-dir holds.
set -x
# WT: a worktree of commit 67ea6c6 holding corpus/python_docs.jsonl; LOGS: the folder of the scripts' logs.
: "${WT:?set WT}" "${LOGS:?set LOGS}"
while ! grep -qx RULESDONE $LOGS/rho09rules.log; do sleep 30; done
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
COMMON="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 150 --jobs 2 --threads 1 --timeout 7200"
P=runs/rho09_plan; R=runs/rho09_run
for seeds in 1,2 3,4; do
  python3 -m experiments.compare_policies $COMMON --seeds $seeds --policies 'bf16;uniform:fp4_block;snip;tail;random;bf16_ends;attn_protected;mlp_only' \
    --out-dir $P --report $P/report.md
  # The run-budget runs on the same bases (copied, with their records), as in gemm_results.md.
  mkdir -p $R
  for s in ${seeds//,/ }; do
    [ -d $R/base_seed$s ] || { cp -r $P/base_seed$s $R/; grep '"policy": "base"' $P/results.jsonl | grep "\"name\": \"base_seed$s\"" >> $R/results.jsonl; }
  done
  python3 -m experiments.compare_policies $COMMON --seeds $seeds --policies 'snip;tail+switch' --set snip.budget=run \
    --out-dir $R --report $R/report.md
done
echo ALLDONE
