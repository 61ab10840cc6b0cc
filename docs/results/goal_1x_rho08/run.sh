#!/bin/bash
# protocol.md (registered before its runs): goal_1x's design at the issue's rho = 0.8. The check (BF16 and
# uniform fp4_block on bases 1-2, order 0, at this study's flags, to equal goal_1x's records:
# the references do not depend on rho), then shipped snip (plan budget), tail+switch and snip+switch (run
# budget) at rho = 0.8 on goal_1x's bases 1-4 (copied from its out-dir $G1), data orders 0-3 in turn.
# Resumable: compare_policies skips the runs an out-dir's results.jsonl holds.
set -x
: "${G1:?set G1: the out-dir holding the goal_1x bases 1-4, runs/g1_o0_plan of its worktree}"
source "$(dirname "$0")/../forward_split/common.sh"
ALL=${ALL//@0.9 --rho 0.9/@0.8 --rho 0.8}  # goal_1x's flags at rho = 0.8
SEEDS=1,2,3,4
copy_bases $G1 runs/g8c 1,2
python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds 1,2 --policies "bf16;uniform:fp4_block" --out-dir runs/g8c --report runs/g8c/report.md
for k in 0 1 2 3; do
  copy_bases $G1 runs/g8_o${k}_plan $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "snip" --out-dir runs/g8_o${k}_plan --report runs/g8_o${k}_plan/report.md
  copy_bases $G1 runs/g8_o${k}_run $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --out-dir runs/g8_o${k}_run --report runs/g8_o${k}_run/report.md
done
echo ALLDONE
