#!/bin/bash
# The goal's 6.46M comparison with replicas (protocol.md, registered before its runs): shipped `snip`
# (plan budget), `tail+switch` and `snip+switch` (run budget) at rho = 0.9 on the reported seeds' 6.46M
# bases 1-4 of ../bf16_time/ (BT4: runs/bt4_plan of a worktree of 02b965d), continued on data orders 1-5
# (--continuation-order) and, for snip+switch, order 0. First shipped snip's and tail+switch's seed 1 at
# order 0 (runs/gr4_repro_*), which must reproduce ../bf16_time/'s records (then its order-0 records pair
# with the rest). Order by order, so that what finishes is whole orders.
# Resumable across sittings: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
: "${WT:?set WT: a worktree of the commit protocol.md names}" "${BT4:?set BT4: runs/bt4_plan of a worktree of 02b965d}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--steps 300 --warmup 20 --interval 100 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --jobs 2 --threads 1"
SHARE="--format-sets fp8_block,fp4_block@0.9 --rho 0.9"
BIG="--base-steps 4000 --eval-interval 4000 --timeout 9000 --set model.hidden_size=256 --set model.ffn_hidden_size=768"
SEEDS=1,2,3,4

copy_bases() {  # $1 = an arm's out-dir, $2 = seeds
  mkdir -p $1
  for s in ${2//,/ }; do
    [ -d $1/base_seed$s ] || { cp -r $BT4/base_seed$s $1/; grep "\"name\": \"base_seed$s\"" $BT4/results.jsonl >> $1/results.jsonl; }
  done
}
plan_arm() {  # $1 = order, $2 = seeds: shipped snip, plan budget
  copy_bases runs/gr4_o$1_plan $2
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $1 --seeds $2 --policies snip --out-dir runs/gr4_o$1_plan --report runs/gr4_o$1_plan/report.md
}
run_arms() {  # $1 = order, $2 = seeds, $3 = policies: run budget
  copy_bases runs/gr4_o$1_run $2
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $1 --seeds $2 --policies "$3" --set snip.budget=run --out-dir runs/gr4_o$1_run --report runs/gr4_o$1_run/report.md
}
# the reproduction check, both runs at once (separate out-dirs)
copy_bases runs/gr4_repro_plan 1; copy_bases runs/gr4_repro_run 1
python3 -m experiments.compare_policies $ALL $BIG $SHARE --seeds 1 --policies snip --out-dir runs/gr4_repro_plan --report runs/gr4_repro_plan/report.md &
python3 -m experiments.compare_policies $ALL $BIG $SHARE --seeds 1 --policies 'tail+switch' --set snip.budget=run --out-dir runs/gr4_repro_run --report runs/gr4_repro_run/report.md &
wait
run_arms 0 $SEEDS 'snip+switch'
for k in 1 2 3 4 5; do
  plan_arm $k $SEEDS
  run_arms $k $SEEDS 'tail+switch;snip+switch'
done
echo ALLDONE
