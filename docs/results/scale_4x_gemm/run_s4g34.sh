#!/bin/bash
# 6.46M per-GEMM study, seeds 3-4, in one script (protocol.md, "Seeds 3-4"): the per-GEMM runs
# with their final checkpoints kept (instead of separate checkpoint reruns), then the evaluation
# of bf16, snip (run) and tail+switch in their own plan and in BF16, then item 7 (cosine, layer).
set -x
# WT: a worktree of commit 18ba018 holding corpus/python_docs.jsonl; MAIN: a checkout whose
# `megatron_snip.evaluate` has --windows (b8273b6 or later); LOGS: the folder of the scripts' logs.
: "${WT:?set WT}" "${MAIN:?set MAIN}" "${LOGS:?set LOGS}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
SEEDS=3,4
COMMON="--base-steps 4000 --steps 300 --warmup 20 --interval 100 --seeds $SEEDS --format-sets fp8_block,fp4_block@0.8 --rho 0.8 --continuation-schedule wsd --no-sweep --set model.hidden_size=256 --set model.ffn_hidden_size=768 --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 4000 --jobs 2 --threads 1 --timeout 9000 --keep-checkpoints"
python3 -m experiments.compare_policies $COMMON --policies 'snip;bf16;uniform:fp4_block' --out-dir runs/s4g_plan --report runs/s4g_plan/report_a.md
mkdir -p runs/s4g_run
for s in ${SEEDS//,/ }; do cp -r runs/s4g_plan/base_seed$s runs/s4g_run/; done
grep '"policy": "base"' runs/s4g_plan/results.jsonl | grep -E '"name": "base_seed(3|4)"' >> runs/s4g_run/results.jsonl
python3 -m experiments.compare_policies $COMMON --policies 'snip;tail+switch' --set snip.budget=run --out-dir runs/s4g_run --report runs/s4g_run/report.md
python3 -m experiments.compare_policies $COMMON --policies 'tail;bf16_ends' --out-dir runs/s4g_plan --report runs/s4g_plan/report_b.md
echo RUNSDONE
# Evaluation with main's evaluate (--windows spread); paths absolute.
ev() { (cd $MAIN && PYTHONPATH=$MAIN python3 -m megatron_snip.evaluate --checkpoint $1/$2 --plan $3 --windows spread --max-sequences 1024 \
  --valid-corpus moby_dick=bundled:moby_dick --valid-corpus python_docs=$WT/corpus/python_docs.jsonl \
  --out $1/eval/$2.$3.json > $1/eval/$2.$3.log 2>&1); }
P=$WT/runs/s4g_plan; R=$WT/runs/s4g_run
mkdir -p $P/eval $R/eval
for s in 3 4; do
  ev $P bf16_seed$s checkpoint & ev $P bf16_seed$s bf16; wait
  for r in snip tail-switch; do ev $R ${r}_fp8_block-fp4_block_rho0.8_seed$s checkpoint & ev $R ${r}_fp8_block-fp4_block_rho0.8_seed$s bf16; wait; done
done
echo EVALDONE
# Item 7: cosine continuation, layer granularity, same bases (as run_s4cos.sh).
COS="--base-steps 4000 --steps 300 --warmup 20 --interval 100 --seeds $SEEDS --format-sets fp8_block,fp4_block@0.8 --rho 0.8 --no-sweep --set model.hidden_size=256 --set model.ffn_hidden_size=768 --set snip.fair_share=true --set snip.granularity=layer --eval-windows spread --eval-batches 128 --eval-interval 4000 --jobs 2 --threads 1 --timeout 9000"
for s in ${SEEDS//,/ }; do cp -r runs/s4g_plan/base_seed$s runs/s4_cos/; done
grep '"policy": "base"' runs/s4g_plan/results.jsonl | grep -E '"name": "base_seed(3|4)"' >> runs/s4_cos/results.jsonl
python3 -m experiments.compare_policies $COS --policies 'snip;bf16_ends' --out-dir runs/s4_cos --report runs/s4_cos/report_a.md
python3 -m experiments.compare_policies $COS --policies 'bf16' --out-dir runs/s4_cos --report runs/s4_cos/report_b.md
echo ALLDONE
