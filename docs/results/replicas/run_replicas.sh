#!/bin/bash
# Continuation replicas (protocol.md, registered before its runs): shipped `snip` (plan budget) and
# `tail+switch` (run budget) at 6.46M, rho = 0.9, on the development bases 11-14 of ../preconditioner/
# (PC: runs/pc4_plan of a worktree of c4943b4), continued on the seed's own data order (0) and on two
# others (--continuation-order 1, 2). Order 0's snip is that study's record; its seed 11 is rerun last.
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
snip_arm() {  # $1 = order, $2 = seeds
  copy_bases runs/rp4_o$1_plan $2
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $1 --seeds $2 --policies snip --out-dir runs/rp4_o$1_plan --report runs/rp4_o$1_plan/report.md
}
rule_arm() {  # $1 = order, $2 = seeds
  copy_bases runs/rp4_o$1_run $2
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $1 --seeds $2 --policies 'tail+switch' --set snip.budget=run --out-dir runs/rp4_o$1_run --report runs/rp4_o$1_run/report.md
}
rule_arm 0 $SEEDS
for k in 1 2; do
  snip_arm $k $SEEDS
  rule_arm $k $SEEDS
done
snip_arm 0 11
echo ALLDONE
