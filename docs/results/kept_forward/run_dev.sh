#!/bin/bash
# protocol.md (registered before its runs): the check (shipped snip on bases 11-12 of forward_split's
# out-dir $FS, order 0, to equal its records), then shipped snip with snip.forward_stickiness = 1 and 0.5
# on bases 11-14, checkpoints kept, each final checkpoint evaluated in its own plan and in BF16.
set -x
: "${FS:?set FS: the forward_split out-dir holding bases 11-14, runs/fs_plan of its worktree}"
source "$(dirname "$0")/../forward_split/common.sh"
SEEDS=11,12,13,14
copy_bases $FS runs/kfc_plan 11,12
python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds 11,12 --policies "snip" --out-dir runs/kfc_plan --report runs/kfc_plan/report.md
for k in 1 0.5; do
  out=runs/kf${k/./}_plan
  copy_bases $FS $out $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds $SEEDS --policies "snip" --set snip.forward_stickiness=$k --out-dir $out --report $out/report.md
  evaluate "checkpoint bf16" $out/snip_*
done
echo ALLDONE
