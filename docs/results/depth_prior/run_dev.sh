#!/bin/bash
# protocol.md (registered before its runs): shipped snip with snip.forward_depth_prior = 1 and 2 on the
# development bases 11-14 of the forward_split out-dir $FS, order 0, checkpoints kept, each final
# checkpoint evaluated in its own plan and in BF16.
set -x
: "${FS:?set FS: the forward_split out-dir holding bases 11-14, runs/fs_plan of its worktree}"
source "$(dirname "$0")/../forward_split/common.sh"
SEEDS=11,12,13,14
for p in 1 2; do
  out=runs/dp${p}_plan
  copy_bases $FS $out $SEEDS
  python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds $SEEDS --policies "snip" --set snip.forward_depth_prior=$p --out-dir $out --report $out/report.md
  evaluate "checkpoint bf16" $out/snip_*
done
echo ALLDONE
