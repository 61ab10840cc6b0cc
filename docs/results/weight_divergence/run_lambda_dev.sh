#!/bin/bash
# protocol.md, "λ on the development seeds": snip at λ = 2 and λ = 0.5 on seeds 11-14 (1.66M), on
# stage 1's bases (runs/wd_norm), each in its own out-dir.
set -x
# WT: the worktree of stage 1 (commit 67ea6c6), after run_dev.sh.
: "${WT:?set WT}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
SEEDS=11,12,13,14
COMMON="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --seeds $SEEDS --format-sets fp8_block,fp4_block@0.8 --rho 0.8 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --eval-windows spread --eval-batches 128 --eval-interval 1000 --jobs 2 --threads 1 --timeout 3600"
for lam in 2 0.5; do
  d=runs/wd_lambda$lam
  mkdir -p $d
  for s in ${SEEDS//,/ }; do cp -r runs/wd_norm/base_seed$s $d/; done
  grep '"policy": "base"' runs/wd_norm/results.jsonl >> $d/results.jsonl
  python3 -m experiments.compare_policies $COMMON --policies 'snip' --set snip.weight_divergence_weight=$lam --out-dir $d --report $d/report.md
done
echo ALLDONE
