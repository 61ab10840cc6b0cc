#!/bin/bash
# snip+switch at 1.66M, rho = 0.9 (../weight_divergence/protocol.md, "Added at 2026-12-05 14:35 UTC"),
# on the protocol of run_rho09.sh. STAGE=dev: development seeds 11-14; STAGE=rep: reported seeds 1-4.
# PART=ref: the reference runs and their bases, from a worktree of commit 67ea6c6 (WT);
# PART=new: snip+switch (and, at dev, a bitwise rerun of tail+switch seed 11) from a worktree of the
# commit that adds it (WT), on copies of PART=ref's bases (REFWT: the PART=ref worktree).
# PART=refrun (STAGE=rep, where the rebuilt bases do not reproduce run_rho09.sh's records): the
# reference runs themselves on PART=ref's bases, from the PART=ref worktree (WT): snip on every
# seed, tail+switch under the run budget.
# Resumable: a rerun skips the runs an out-dir holds.
set -x
# WT, REFWT: worktrees holding corpus/python_docs.jsonl.
: "${WT:?set WT}" "${STAGE:?set STAGE=dev|rep}" "${PART:?set PART=ref|new|refrun}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
COMMON="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 150 --jobs 2 --threads 1 --timeout 7200"
case $STAGE in
  dev) SEEDS=11,12,13,14 ;;
  rep) SEEDS=1,2,3,4 ;;
esac
P=runs/sw_${STAGE}_plan; R=runs/sw_${STAGE}_run
copy_bases() {  # copy_bases FROM TO: the bases of SEEDS and their records
  mkdir -p $2
  for s in ${SEEDS//,/ }; do
    [ -d $2/base_seed$s ] || { cp -r $1/base_seed$s $2/; grep '"policy": "base"' $1/results.jsonl | grep "\"name\": \"base_seed$s\"" >> $2/results.jsonl; }
  done
}
if [ $PART = refrun ]; then
  python3 -m experiments.compare_policies $COMMON --seeds $SEEDS --policies 'snip' --out-dir $P --report $P/report.md
  copy_bases $P $R
  python3 -m experiments.compare_policies $COMMON --seeds $SEEDS --policies 'tail+switch' --set snip.budget=run --out-dir $R --report $R/report.md
elif [ $PART = ref ]; then
  if [ $STAGE = dev ]; then
    python3 -m experiments.compare_policies $COMMON --seeds $SEEDS --policies 'bf16;snip' --out-dir $P --report $P/report.md
    copy_bases $P $R
    python3 -m experiments.compare_policies $COMMON --seeds $SEEDS --policies 'tail+switch' --set snip.budget=run --out-dir $R --report $R/report.md
  else  # the rebuilt bases' check against run_rho09.sh's records: every bf16 run and seed 1's snip
    python3 -m experiments.compare_policies $COMMON --seeds $SEEDS --policies 'bf16' --out-dir $P --report $P/report.md
    python3 -m experiments.compare_policies $COMMON --seeds 1 --policies 'snip' --out-dir $P --report $P/report.md
  fi
else
  : "${REFWT:?set REFWT}"
  copy_bases $REFWT/$P $R
  python3 -m experiments.compare_policies $COMMON --seeds $SEEDS --policies 'snip+switch' --set snip.budget=run --out-dir $R --report $R/report.md
  if [ $STAGE = dev ]; then  # the pairing with PART=ref's runs: tail+switch seed 11 again, bit for bit
    SEEDS=11 copy_bases $REFWT/$P $R.check
    python3 -m experiments.compare_policies $COMMON --seeds 11 --policies 'tail+switch' --set snip.budget=run --out-dir $R.check --report $R.check/report.md
  fi
fi
echo ALLDONE
