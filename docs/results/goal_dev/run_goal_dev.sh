#!/bin/bash
# The goal test's replication on the development bases (protocol.md, registered before its runs):
# `snip+switch` (run budget) at 6.46M, rho = 0.9, on the development bases 11-14 of ../preconditioner/
# (PC: runs/pc4_plan of a worktree of c4943b4) at data orders 0-2, where ../replicas/ holds `snip` and
# `tail+switch`; then all three arms at orders 3 and 4. Whole orders, one at a time.
# Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
: "${WT:?set WT: a worktree of the commit protocol.md names}" "${PC:?set PC: runs/pc4_plan of a worktree of c4943b4}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--steps 300 --warmup 20 --interval 100 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --jobs 2 --threads 1"
SHARE="--format-sets fp8_block,fp4_block@0.9 --rho 0.9"
BIG="--base-steps 4000 --eval-interval 4000 --timeout 9000 --set model.hidden_size=256 --set model.ffn_hidden_size=768"
SEEDS=11,12,13,14

copy_bases() {  # $1 = an arm's out-dir, $2 = seeds
  mkdir -p $1
  for s in ${2//,/ }; do
    [ -d $1/base_seed$s ] || { cp -r $PC/base_seed$s $1/; grep "\"name\": \"base_seed$s\"" $PC/results.jsonl >> $1/results.jsonl; }
  done
}
plan_arm() {  # $1 = order, $2 = seeds: shipped snip, plan budget
  copy_bases runs/gd4_o$1_plan $2
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $1 --seeds $2 --policies snip --out-dir runs/gd4_o$1_plan --report runs/gd4_o$1_plan/report.md
}
run_arms() {  # $1 = order, $2 = seeds, $3 = policies: run budget
  copy_bases runs/gd4_o$1_run $2
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $1 --seeds $2 --policies "$3" --set snip.budget=run --out-dir runs/gd4_o$1_run --report runs/gd4_o$1_run/report.md
}
for k in 0 1 2; do
  run_arms $k $SEEDS 'snip+switch'
done
for k in 3 4; do
  plan_arm $k $SEEDS
  run_arms $k $SEEDS 'tail+switch;snip+switch'
done
echo ALLDONE
