#!/bin/bash
# snip.cost_ema = 0.5 against the shipped 0 (protocol.md, registered before its runs). Stage 1: 6.46M
# on development seeds 11-14, on copies of the bases of ../preconditioner/ (runs/pc4_plan), both arms
# on this commit. STAGE=2 (only if stage 1 passes): seeds 1-4 at 6.46M and then 1.66M on copies of the
# bases of ../bf16_time/ (BT: the runs/ folder of a worktree of 02b965d), both arms and bf16 on this commit.
# Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
# WT: a worktree of the commit protocol.md names; PC: the out-dir holding the preconditioner study's bases.
: "${WT:?set WT}" "${PC:?set PC: runs/pc4_plan of a worktree of c4943b4}"
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
arms() {  # $1 = out-dir prefix, $2 = seeds, $3 = size flags, $4 = the shipped arm's policies
  python3 -m experiments.compare_policies $ALL $3 $SHARE --seeds $2 --policies "$4" --out-dir $1_plan --report $1_plan/report.md
  python3 -m experiments.compare_policies $ALL $3 $SHARE --seeds $2 --policies 'snip' --set snip.cost_ema=0.5 --out-dir $1_ema --report $1_ema/report.md
}
if [ "${STAGE:-1}" = 1 ]; then
  for seeds in 11,12 13,14; do
    copy_bases $PC runs/ce4_plan $seeds
    copy_bases $PC runs/ce4_ema $seeds
    arms runs/ce4 $seeds "$BIG" snip
  done
else
  : "${BT:?set BT: the runs/ folder of a worktree of 02b965d}"
  for seeds in 1,2 3,4; do
    copy_bases $BT/bt4_plan runs/ce4r_plan $seeds
    copy_bases $BT/bt4_plan runs/ce4r_ema $seeds
    arms runs/ce4r $seeds "$BIG" snip,bf16
  done
  copy_bases $BT/bt_plan runs/cer_plan 1,2,3,4
  copy_bases $BT/bt_plan runs/cer_ema 1,2,3,4
  arms runs/cer 1,2,3,4 "$SMALL" snip,bf16
fi
echo ALLDONE
