#!/bin/bash
# 6.46M, rho = 0.9: four more reported seeds (41-44, never used before) for shipped `snip` (plan
# budget), `tail+switch` (run budget), `bf16` and uniform `fp4_block`, then uniform on seeds 1-4 and
# `snip+switch` on 41-44 (protocol.md, "Added at 2026-12-06 03:32 UTC"). The same commit (11ea84d),
# command line and out-dirs as run_s4g_snip_switch.sh, on the machine that ran it, so that seeds 1-4
# and 41-44 pool into one 8-seed comparison. Order: per seed pair, bases and `snip`/`bf16` in $P,
# then `tail+switch` in $R on copies of the same bases; so what finishes is complete pairs.
# Resumable: a rerun skips the runs an out-dir's results.jsonl holds.
set -x
# WT: the worktree of commit 11ea84d that ran run_s4g_snip_switch.sh (runs/s4g_sw_{plan,run}).
: "${WT:?set WT}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
COMMON="--base-steps 4000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set model.hidden_size=256 --set model.ffn_hidden_size=768 --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 4000 --jobs 2 --threads 1 --timeout 9000"
R=runs/s4g_sw_run; P=runs/s4g_sw_plan
for pair in "41 42" "43 44"; do
  seeds=${pair/ /,}
  python3 -m experiments.compare_policies $COMMON --seeds $seeds --policies 'snip;bf16' --out-dir $P --report $P/report.md
  for s in $pair; do
    [ -d $R/base_seed$s ] || { cp -r $P/base_seed$s $R/; grep '"policy": "base"' $P/results.jsonl | grep "\"name\": \"base_seed$s\"" >> $R/results.jsonl; }
  done
  python3 -m experiments.compare_policies $COMMON --seeds $seeds --policies 'tail+switch' --set snip.budget=run --out-dir $R --report $R/report.md
done
python3 -m experiments.compare_policies $COMMON --seeds 41,42,43,44,1,2,3,4 --policies 'uniform:fp4_block' --out-dir $P --report $P/report.md
python3 -m experiments.compare_policies $COMMON --seeds 41,42,43,44 --policies 'snip+switch' --set snip.budget=run --out-dir $R --report $R/report.md
echo ALLDONE
