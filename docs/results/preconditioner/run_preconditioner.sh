#!/bin/bash
# snip.preconditioner "with_probe" against the shipped "stored" (protocol.md, registered before its
# runs): stage 1, 6.46M on development seeds 11-14, per seed pair: one BF16 base, then on copies of it
# shipped `snip` and `bf16` (runs/pc4_plan) and `snip` with the probe gradient folded into v̂
# (runs/pc4_probe). Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
# WT: a worktree of the commit the protocol names (every run of the study on that one commit).
: "${WT:?set WT}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--steps 300 --warmup 20 --interval 100 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --jobs 2 --threads 1"
SHARE="--format-sets fp8_block,fp4_block@0.9 --rho 0.9"
BIG="--base-steps 4000 --eval-interval 4000 --timeout 9000 --set model.hidden_size=256 --set model.ffn_hidden_size=768"

# $1 = out-dir prefix, $2 = comma-separated seeds.
stage() {
  local P=$1_plan Q=$1_probe seeds=$2
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --seeds $seeds --policies 'snip' --out-dir $P --report $P/report.md
  mkdir -p $Q
  for s in ${seeds//,/ }; do
    [ -d $Q/base_seed$s ] || { cp -r $P/base_seed$s $Q/; grep "\"name\": \"base_seed$s\"" $P/results.jsonl >> $Q/results.jsonl; }
  done
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --seeds $seeds --policies 'snip' --set snip.preconditioner=with_probe --out-dir $Q --report $Q/report.md
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --seeds $seeds --policies 'bf16' --out-dir $P --report $P/report.md
}
stage runs/pc4 11,12
stage runs/pc4 13,14
echo ALLDONE
