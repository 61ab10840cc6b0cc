#!/bin/bash
# The two production rules not yet run at 6.46M (Nemotron's attention protection, MaxText's MLP-only
# FP4), per GEMM under the plan budget, seeds 1-4, after run_s4g34.sh.
set -x
# WT: a worktree of commit 18ba018 holding corpus/python_docs.jsonl; LOGS: the folder of the scripts' logs.
: "${WT:?set WT}" "${LOGS:?set LOGS}"
while ! grep -qx ALLDONE $LOGS/s4g34.log; do sleep 30; done
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
COMMON="--base-steps 4000 --steps 300 --warmup 20 --interval 100 --seeds 1,2,3,4 --format-sets fp8_block,fp4_block@0.8 --rho 0.8 --continuation-schedule wsd --no-sweep --set model.hidden_size=256 --set model.ffn_hidden_size=768 --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 4000 --jobs 2 --threads 1 --timeout 9000"
python3 -m experiments.compare_policies $COMMON --policies 'attn_protected;mlp_only' --out-dir runs/s4g_plan --report runs/s4g_plan/report_c.md
echo ALLDONE
