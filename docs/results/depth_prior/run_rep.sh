#!/bin/bash
# protocol_rep.md (registered before its runs): the check (tail+switch on bases 1-2, order 0, to equal
# goal_1x's records), then shipped snip with snip.forward_depth_prior = $P on goal_1x's bases 1-4 (copied
# from its out-dir $G1) at data orders 0-3, checkpoints kept; at orders 0-1 each final checkpoint
# evaluated in its own plan and in BF16. Resumable: compare_policies skips finished runs.
set -x
: "${G1:?set G1: the out-dir holding the goal_1x bases 1-4, runs/g1_o0_plan of its worktree}"
: "${P:?set P: the chosen snip.forward_depth_prior of the development probe}"
source "$(dirname "$0")/../forward_split/common.sh"
SEEDS=1,2,3,4
copy_bases $G1 runs/drc 1,2
python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds 1,2 --policies "tail+switch" --set snip.budget=run --out-dir runs/drc --report runs/drc/report.md
for k in 0 1 2 3; do
  copy_bases $G1 runs/dr_o$k $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "snip" --set snip.forward_depth_prior=$P --out-dir runs/dr_o$k --report runs/dr_o$k/report.md
  [ $k -le 1 ] && evaluate "checkpoint bf16" runs/dr_o$k/snip_*
done
echo ALLDONE
