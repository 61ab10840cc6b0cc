#!/bin/bash
# snip.weight_divergence = "loss" against the shipped "norm" (protocol.md, registered before its runs).
# Stage 1: 6.46M on development seeds 11-14, on copies of the bases of ../preconditioner/ (PC: runs/pc4_plan
# of a worktree of c4943b4); the shipped arm's seed 11 is rerun on this commit to check it reproduces.
# STAGE=2 (only if stage 1 passes): seeds 1-4 at 6.46M, then 1.66M, on copies of the bases of ../bf16_time/
# (BT: the runs/ folder of a worktree of 02b965d); the shipped arm's seed 1 rerun at each size.
# Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
: "${WT:?set WT: a worktree of the commit protocol.md names}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--steps 300 --warmup 20 --interval 100 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --jobs 2 --threads 1"
SHARE="--format-sets fp8_block,fp4_block@0.9 --rho 0.9"
BIG="--base-steps 4000 --eval-interval 4000 --timeout 9000 --set model.hidden_size=256 --set model.ffn_hidden_size=768"
SMALL="--base-steps 1000 --eval-interval 150 --timeout 7200"

copy_bases() {  # $1 = the out-dir holding the bases, $2 = an arm's out-dir, $3 = seeds
  mkdir -p $2
  for s in ${3//,/ }; do
    [ -d $2/base_seed$s ] || { cp -r $1/base_seed$s $2/; grep "\"name\": \"base_seed$s\"" $1/results.jsonl >> $2/results.jsonl; }
  done
}
loss_arm() {  # $1 = out-dir, $2 = seeds, $3 = size flags
  python3 -m experiments.compare_policies $ALL $3 $SHARE --seeds $2 --policies snip --set snip.weight_divergence=loss --out-dir $1 --report $1/report.md
}
shipped_arm() {  # $1 = out-dir, $2 = seeds, $3 = size flags
  python3 -m experiments.compare_policies $ALL $3 $SHARE --seeds $2 --policies snip --out-dir $1 --report $1/report.md
}
if [ "${STAGE:-1}" = 1 ]; then
  : "${PC:?set PC: runs/pc4_plan of a worktree of c4943b4}"
  copy_bases $PC runs/lu4_loss 11,12,13,14
  copy_bases $PC runs/lu4_plan 11
  loss_arm runs/lu4_loss 11,12 "$BIG"
  shipped_arm runs/lu4_plan 11 "$BIG"
  loss_arm runs/lu4_loss 13,14 "$BIG"
else
  : "${BT:?set BT: the runs/ folder of a worktree of 02b965d}"
  copy_bases $BT/bt4_plan runs/lu4r_loss 1,2,3,4
  copy_bases $BT/bt4_plan runs/lu4r_plan 1
  loss_arm runs/lu4r_loss 1,2 "$BIG"
  shipped_arm runs/lu4r_plan 1 "$BIG"
  loss_arm runs/lu4r_loss 3,4 "$BIG"
  copy_bases $BT/bt_plan runs/lur_loss 1,2,3,4
  copy_bases $BT/bt_plan runs/lur_plan 1
  loss_arm runs/lur_loss 1,2,3,4 "$SMALL"
  shipped_arm runs/lur_plan 1 "$SMALL"
fi
echo ALLDONE
