#!/bin/bash
# Stage 1 of protocol.md: development seeds 11-14 at 1.66M, shipped SNIP ("norm") against the
# squared weight divergence, with bf16, uniform FP4 and tail for scale.
set -x
# WT: a worktree of the commit that adds snip.weight_divergence, holding corpus/python_docs.jsonl.
: "${WT:?set WT}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
SEEDS=11,12,13,14
COMMON="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --seeds $SEEDS --format-sets fp8_block,fp4_block@0.8 --rho 0.8 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --eval-windows spread --eval-batches 128 --eval-interval 1000 --jobs 2 --threads 1 --timeout 3600"
python3 -m experiments.compare_policies $COMMON --policies 'snip;tail;bf16;uniform:fp4_block' --out-dir runs/wd_norm --report runs/wd_norm/report.md
mkdir -p runs/wd_sq
for s in ${SEEDS//,/ }; do cp -r runs/wd_norm/base_seed$s runs/wd_sq/; done
grep '"policy": "base"' runs/wd_norm/results.jsonl >> runs/wd_sq/results.jsonl
python3 -m experiments.compare_policies $COMMON --policies 'snip' --set snip.weight_divergence=squared --out-dir runs/wd_sq --report runs/wd_sq/report.md
echo ALLDONE
