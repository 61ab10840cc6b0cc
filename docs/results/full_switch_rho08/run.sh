#!/bin/bash
# protocol.md (registered before its runs): at rho = 0.8 on goal_1x's bases 1-4 (copied from the out-dir $G1),
# data orders 0-3 in turn. At orders 0-1 the references and the check first: tail+switch and snip+switch
# (run budget, default share grid), to equal goal_1x_rho08's records. Then tail+switch, snip+switch and
# snip with the run budget over the whole share range (snip.budget_share_range = [0.0, 1.0]). At orders
# 0-1 each final checkpoint of both out-dirs is evaluated with every GEMM in BF16 (the new arms at order 0
# in their own plans too). Resumable: compare_policies skips finished runs and an evaluation is skipped
# when its JSON exists.
set -x
: "${G1:?set G1: the out-dir holding the goal_1x bases 1-4}"
source "$(dirname "$0")/../forward_split/common.sh"
ALL=${ALL//@0.9 --rho 0.9/@0.8 --rho 0.8}  # goal_1x_rho08's flags
SEEDS=1,2,3,4
for k in 0 1 2 3; do
  if [ $k -le 1 ]; then
    copy_bases $G1 runs/f8r_o$k $SEEDS
    python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --out-dir runs/f8r_o$k --report runs/f8r_o$k/report.md
  fi
  copy_bases $G1 runs/f8_o$k $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order $k --seeds $SEEDS --policies "tail+switch;snip+switch;snip" --set snip.budget=run --set 'snip.budget_share_range=[0.0, 1.0]' --out-dir runs/f8_o$k --report runs/f8_o$k/report.md
  if [ $k -le 1 ]; then
    new="bf16"; [ $k = 0 ] && new="checkpoint bf16"
    evaluate "$new" runs/f8_o$k/*_seed*
    evaluate bf16 runs/f8r_o$k/*_seed*
  fi
done
echo ALLDONE
