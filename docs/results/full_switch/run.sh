#!/bin/bash
# protocol.md (registered before its runs): the check (snip+switch on bases 1-2, order 0, at the default
# share grid, to equal goal_1x's records), then tail+switch and snip+switch with the run budget's share
# grid topped at 1.0 (snip.budget_share_range = [0.5, 1.0]) on goal_1x's bases 1-4 (copied from its
# out-dir $G1) at data orders 0-3, final checkpoints kept; at orders 0-1 each final checkpoint evaluated
# in its own plan and with every GEMM in BF16. Resumable: compare_policies skips finished runs and an
# evaluation is skipped when its JSON exists.
set -x
: "${G1:?set G1: the out-dir holding the goal_1x bases 1-4, runs/g1_o0_plan of its worktree}"
source "$(dirname "$0")/../forward_split/common.sh"
SEEDS=1,2,3,4
copy_bases $G1 runs/fwc 1,2
python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds 1,2 --policies "snip+switch" --set snip.budget=run --out-dir runs/fwc --report runs/fwc/report.md
for k in 0 1 2 3; do
  copy_bases $G1 runs/fw_o$k $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --set 'snip.budget_share_range=[0.5, 1.0]' --out-dir runs/fw_o$k --report runs/fw_o$k/report.md
  [ $k -le 1 ] && evaluate "checkpoint bf16" runs/fw_o$k/*_seed*
done
echo ALLDONE
