#!/bin/bash
# protocol.md (registered before the new arm's runs): at 6.46M, rho = 0.9, on the development bases 11-14,
# `snip` with the run budget over the whole share range (SNIP's own cost curve allocates the FP4 share over
# the continuation) at data orders 0-4, against goal_dev's recorded `snip`, `tail+switch` and `snip+switch`
# of the same bases and orders. One pair of bases per sitting (SEEDS: 11,12, then 13,14).
# Step 1 trains the pair's bases (deterministic: each sitting on a new machine trains them again) and reruns
# the preconditioner study's shipped `snip` at order 0 on them: the check that this commit reproduces the
# records. Step 2 runs the new arm at orders 0-4 in turn.
# Resumable: every out-dir is first seeded with this folder's committed records (REC: this folder in the
# latest checkout), so finished runs are skipped and a base is trained again only if a run left needs it.
set -x
: "${WT:?set WT: a worktree of the registering commit}" "${REC:?set REC: this folder in the latest checkout}"
: "${SEEDS:?set SEEDS: the pair of bases of this sitting, 11,12 then 13,14}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--steps 300 --warmup 20 --interval 100 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --jobs 2 --threads 1"
SHARE="--format-sets fp8_block,fp4_block@0.9 --rho 0.9"
BIG="--base-steps 4000 --eval-interval 4000 --timeout 9000 --set model.hidden_size=256 --set model.ffn_hidden_size=768"

seed_records() {  # $1 = an out-dir, $2 = its committed records: their finished runs are skipped
  mkdir -p $1
  [ -f $1/results.jsonl ] || [ ! -f $2 ] || cp $2 $1/results.jsonl
}
has_bases() {  # $1 = an out-dir: does it hold this sitting's bases' checkpoints?
  for s in ${SEEDS//,/ }; do [ -d $1/base_seed$s/checkpoints ] || return 1; done
}
copy_bases() {  # $1 = the out-dir holding the bases, $2 = an arm's out-dir
  for s in ${SEEDS//,/ }; do
    [ -d $2/base_seed$s ] && continue
    cp -r $1/base_seed$s $2/
    line=$(grep "\"name\": \"base_seed$s\"" $1/results.jsonl | tail -1)
    grep -qF "$line" $2/results.jsonl 2>/dev/null || echo "$line" >> $2/results.jsonl
  done
}

seed_records runs/pc4_plan $REC/results_check.jsonl
python3 -m experiments.compare_policies $ALL $BIG $SHARE --seeds $SEEDS --policies snip --out-dir runs/pc4_plan --report runs/pc4_plan/report.md
B=runs/pc4_plan  # where this sitting's bases are (an order's out-dir trains them if no earlier step did)
for k in 0 1 2 3 4; do
  out=runs/oc_o$k
  seed_records $out $REC/results_oc_o$k.jsonl
  has_bases $B && copy_bases $B $out
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $k --seeds $SEEDS --policies snip --set snip.budget=run --set 'snip.budget_share_range=[0.0, 1.0]' --out-dir $out --report $out/report.md
  has_bases $B || B=$out
done
echo ALLDONE
