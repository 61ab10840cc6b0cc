#!/bin/bash
# Issue #33's goal at 1.66M with continuation replicas (protocol.md, registered before its runs): BF16,
# uniform `fp4_block` and shipped `snip` (plan budget), `tail+switch` and `snip+switch` (run budget) at
# rho = 0.9 on the reported seeds' 1.66M bases 1-4, built here, continued on data orders 0-3. The
# protocol of ../run_budget/snip_switch_results.md (runs/sw_rep_*) plus --continuation-order.
# Whole orders, one at a time. Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
: "${WT:?set WT: a worktree of the commit protocol.md names}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 150 --jobs 2 --threads 1 --timeout 7200"
SEEDS=1,2,3,4
BASES=runs/g1_o0_plan  # the first out-dir builds the bases; the others copy them

copy_bases() {  # $1 = an out-dir
  mkdir -p $1
  for s in ${SEEDS//,/ }; do
    [ -d $1/base_seed$s ] || { cp -r $BASES/base_seed$s $1/; grep "\"name\": \"base_seed$s\"" $BASES/results.jsonl >> $1/results.jsonl; }
  done
}
for k in 0 1 2 3; do
  [ $k = 0 ] || copy_bases runs/g1_o${k}_plan
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "bf16;uniform:fp4_block;snip" --out-dir runs/g1_o${k}_plan --report runs/g1_o${k}_plan/report.md
  copy_bases runs/g1_o${k}_run
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --out-dir runs/g1_o${k}_run --report runs/g1_o${k}_run/report.md
done
echo ALLDONE
