#!/bin/bash
# `bf16` as a SNIP candidate at equal modelled GEMM time (protocol.md, registered before its runs):
# per seed one BF16 base, then on copies of it shipped `snip` (FP4 share 0.9), `snip` and `tail` on
# {bf16, fp8_block, fp4_block} under a GEMM-time budget of 0.2743 (B200 ratios, fp4_block priced as
# native FP4), NVIDIA's `tail+switch` (run budget), `bf16` and uniform `fp4_block`. 1.66M on seeds 1-4
# first, then 6.46M per seed pair (1-2, then 3-4) so that what finishes is complete seeds.
# Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
# WT: a worktree of the commit the protocol names (every run of the study on that one commit).
: "${WT:?set WT}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--steps 300 --warmup 20 --interval 100 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --jobs 2 --threads 1"
SHARE="--format-sets fp8_block,fp4_block@0.9 --rho 0.9"
TIME="--target gemm_time --time-costs bf16=1,fp8_block=0.5,fp4_block=0.25 --format-sets bf16,fp8_block,fp4_block@0.2743 --rho 0.2743"
SMALL="--base-steps 1000 --eval-interval 150 --timeout 7200"
BIG="--base-steps 4000 --eval-interval 4000 --timeout 9000 --set model.hidden_size=256 --set model.ffn_hidden_size=768"

# One size, a comma-separated seed list: $1 = size options, $2 = out-dir prefix, $3 = seeds.
stage() {
  local size=$1 P=$2_plan R=$2_run T=$2_time seeds=$3
  python3 -m experiments.compare_policies $ALL $size $SHARE --seeds $seeds --policies 'bf16;snip' --out-dir $P --report $P/report.md
  for out in $R $T; do
    mkdir -p $out
    for s in ${seeds//,/ }; do
      [ -d $out/base_seed$s ] || { cp -r $P/base_seed$s $out/; grep "\"name\": \"base_seed$s\"" $P/results.jsonl >> $out/results.jsonl; }
    done
  done
  python3 -m experiments.compare_policies $ALL $size $TIME --seeds $seeds --policies 'snip;tail' --out-dir $T --report $T/report.md
  python3 -m experiments.compare_policies $ALL $size $SHARE --seeds $seeds --policies 'tail+switch' --set snip.budget=run --out-dir $R --report $R/report.md
  python3 -m experiments.compare_policies $ALL $size $SHARE --seeds $seeds --policies 'uniform:fp4_block' --out-dir $P --report $P/report.md
}
stage "$SMALL" runs/bt 1,2,3,4
stage "$BIG" runs/bt4 1,2
stage "$BIG" runs/bt4 3,4
echo ALLDONE
