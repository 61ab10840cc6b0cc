#!/bin/bash
# The split of protocol_rep.md (registered before its runs) on the reported seeds: ../goal_1x/'s
# BF16, shipped `snip`, `tail+switch` and `snip+switch` continuations of bases 1-4 at data orders 0
# and 1, rerun with their final checkpoints kept, then each non-BF16 run's final checkpoint evaluated
# with every GEMM in BF16 (and, at order 0, in its own plan: the check). The bases are ../goal_1x/'s,
# copied from its out-dir ($G1). Resumable: compare_policies skips the runs an out-dir's results.jsonl
# holds; an evaluation is skipped when its JSON exists.
set -x
: "${G1:?set G1: the out-dir holding the goal_1x bases 1-4, runs/g1_o0_plan of its worktree}"
source "$(dirname "$0")/common.sh"
SEEDS=1,2,3,4
for k in 0 1; do
  plans="bf16"; [ $k = 0 ] && plans="bf16 checkpoint"
  copy_bases $G1 runs/fsr_o${k}_plan $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "bf16;snip" --out-dir runs/fsr_o${k}_plan --report runs/fsr_o${k}_plan/report.md
  copy_bases $G1 runs/fsr_o${k}_run $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --out-dir runs/fsr_o${k}_run --report runs/fsr_o${k}_run/report.md
  evaluate "$plans" runs/fsr_o${k}_plan/snip_* runs/fsr_o${k}_run/*_seed*
done
echo ALLDONE
