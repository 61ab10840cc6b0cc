#!/bin/bash
# snip.probe_batches = 4 against the shipped 2 (protocol.md, registered before its runs). Stage 1:
# 6.46M on development seeds 11-14, on copies of the bases of ../preconditioner/ (runs/pc4_plan, the
# same commit c4943b4, whose shipped `snip` and `bf16` runs are the references). Stage 2 (only if
# stage 1 passes): seeds 1-4 at 6.46M and 1.66M on copies of the bases of ../bf16_time/ (commit
# 02b965d; BF16 training with SNIP off has no code change from there to c4943b4), both arms rerun.
# Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
# WT: a worktree of c4943b4 (every run of the study on that one commit).
: "${WT:?set WT}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--steps 300 --warmup 20 --interval 100 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --jobs 2 --threads 1"
SHARE="--format-sets fp8_block,fp4_block@0.9 --rho 0.9"
BIG="--base-steps 4000 --eval-interval 4000 --timeout 9000 --set model.hidden_size=256 --set model.ffn_hidden_size=768"
SMALL="--base-steps 1000 --eval-interval 150 --timeout 7200"

# $1 = the out-dir holding the bases, $2 = the new arm's out-dir, $3 = seeds, $4 = size flags
copy_bases() {
  mkdir -p $2
  for s in ${3//,/ }; do
    [ -d $2/base_seed$s ] || { cp -r $1/base_seed$s $2/; grep "\"name\": \"base_seed$s\"" $1/results.jsonl >> $2/results.jsonl; }
  done
}
probe4() {  # $1 = out-dir, $2 = seeds, $3 = size flags
  python3 -m experiments.compare_policies $ALL $3 $SHARE --seeds $2 --policies 'snip' --set snip.probe_batches=4 --out-dir $1 --report $1/report.md
}
shipped() {  # shipped snip and bf16 on the bases in $1
  python3 -m experiments.compare_policies $ALL $3 $SHARE --seeds $2 --policies 'snip,bf16' --out-dir $1 --report $1/report.md
}
stage=${STAGE:-1}
if [ $stage = 1 ]; then
  copy_bases runs/pc4_plan runs/pb4_probe4 11,12,13,14
  probe4 runs/pb4_probe4 11,12 "$BIG"
  probe4 runs/pb4_probe4 13,14 "$BIG"
else
  : "${BT:?set BT: the runs/ folder of a worktree of 02b965d (bases of the bf16_time study)}"
  copy_bases $BT/bt4_plan runs/pb4r_plan 1,2,3,4
  copy_bases $BT/bt4_plan runs/pb4r_probe4 1,2,3,4
  for seeds in 1,2 3,4; do
    shipped runs/pb4r_plan $seeds "$BIG"
    probe4 runs/pb4r_probe4 $seeds "$BIG"
  done
  copy_bases $BT/bt_plan runs/pbr_plan 1,2,3,4
  copy_bases $BT/bt_plan runs/pbr_probe4 1,2,3,4
  shipped runs/pbr_plan 1,2,3,4 "$SMALL"
  probe4 runs/pbr_probe4 1,2,3,4 "$SMALL"
fi
echo ALLDONE
