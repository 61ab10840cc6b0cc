#!/bin/bash
# The split of protocol_rep.md (registered before its runs) on the reported seeds: ../goal_1x/'s
# BF16, shipped `snip`, `tail+switch` and `snip+switch` continuations of bases 1-4 at data orders 0
# and 1, rerun with their final checkpoints kept, then each non-BF16 run's final checkpoint evaluated
# with every GEMM in BF16 (and, at order 0, in its own plan: the check). The bases are ../goal_1x/'s,
# copied from its out-dir ($G1). Resumable: compare_policies skips the runs an out-dir's results.jsonl
# holds; an evaluation is skipped when its JSON exists.
set -x
: "${WT:?set WT: a worktree of the commit protocol_rep.md names}"
: "${G1:?set G1: the out-dir holding the goal_1x bases 1-4, runs/g1_o0_plan of its worktree}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 150 --jobs 2 --threads 1 --timeout 7200 --keep-checkpoints"
SEEDS=1,2,3,4
copy_bases() {  # $1 = an out-dir
  mkdir -p $1
  for s in ${SEEDS//,/ }; do
    [ -d $1/base_seed$s ] || { cp -r $G1/base_seed$s $1/; grep "\"name\": \"base_seed$s\"" $G1/results.jsonl >> $1/results.jsonl; }
  done
}
evaluate() {  # $1 = an out-dir, $2 = the plans to evaluate in
  for d in $1/*_seed*; do
    case $d in */base_seed*|*/bf16_seed*) continue;; esac
    for plan in $2; do [ -f $d/eval_$plan.json ] || echo "$d $plan"; done
  done | xargs -P 2 -L 1 sh -c 'python3 -m megatron_snip.evaluate --checkpoint $0 --plan $1 --windows spread --max-sequences 1024 --valid-corpus moby_dick=bundled:moby_dick --valid-corpus python_docs=corpus/python_docs.jsonl --out $0/eval_$1.json'
}
for k in 0 1; do
  plans="bf16"; [ $k = 0 ] && plans="bf16 checkpoint"
  copy_bases runs/fsr_o${k}_plan
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "bf16;snip" --out-dir runs/fsr_o${k}_plan --report runs/fsr_o${k}_plan/report.md
  copy_bases runs/fsr_o${k}_run
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --out-dir runs/fsr_o${k}_run --report runs/fsr_o${k}_run/report.md
  evaluate runs/fsr_o${k}_plan "$plans"
  evaluate runs/fsr_o${k}_run "$plans"
done
echo ALLDONE
