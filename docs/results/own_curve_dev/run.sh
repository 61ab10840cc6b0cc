#!/bin/bash
# protocol.md (registered before the new arm's runs): at 6.46M, rho = 0.9, on development bases trained in this
# sitting (SEEDS: a pair, 11,12 then 13,14), shipped `snip` (plan budget), NVIDIA's `tail+switch` (run budget,
# default share grid) and `snip` with the run budget over the whole share range (SNIP's own cost curve
# allocates the FP4 share over the continuation), at data orders 0 and 1. Every arm runs on this sitting's
# bases: a 6.46M base does not train bit for bit alike on another machine.
# Out-dirs: runs/pc4_plan (the bases and `snip` at order 0), runs/ocp_o<k> (`snip`, k >= 1),
# runs/ocr_o<k> (`tail+switch`), runs/oc_o<k> (the new arm).
# Resumable within a sitting: every out-dir is first seeded with this folder's committed records (REC: this
# folder in the latest checkout), so finished runs are skipped.
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
copy_bases() {  # $1 = an arm's out-dir: this sitting's bases from runs/pc4_plan, with their records
  for s in ${SEEDS//,/ }; do
    [ -d $1/base_seed$s ] && continue
    cp -r runs/pc4_plan/base_seed$s $1/
    line=$(grep "\"name\": \"base_seed$s\"" runs/pc4_plan/results.jsonl | tail -1)
    grep -qF "$line" $1/results.jsonl 2>/dev/null || echo "$line" >> $1/results.jsonl
  done
}
arm() {  # $1 = order, $2 = out-dir kind, $3 = policy, the rest: its --set flags
  local k=$1 out=runs/$2_o$1 policy=$3; shift 3
  seed_records $out $REC/results_$2_o$k.jsonl
  copy_bases $out
  python3 -m experiments.compare_policies $ALL $BIG $SHARE --continuation-order $k --seeds $SEEDS --policies "$policy" "$@" --out-dir $out --report $out/report.md
}

seed_records runs/pc4_plan $REC/results_ocp_o0.jsonl
python3 -m experiments.compare_policies $ALL $BIG $SHARE --seeds $SEEDS --policies snip --out-dir runs/pc4_plan --report runs/pc4_plan/report.md
for k in 0 1; do
  arm $k oc snip --set snip.budget=run --set 'snip.budget_share_range=[0.0, 1.0]'
  arm $k ocr tail+switch --set snip.budget=run
  [ $k = 0 ] || arm $k ocp snip
done
echo ALLDONE
