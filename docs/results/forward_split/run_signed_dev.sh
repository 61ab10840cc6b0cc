#!/bin/bash
# protocol_signed.md (registered before its runs): shipped `snip` with `snip.loss_first_order = "signed"`
# on the development bases 11-14 (copied from the forward_split out-dir $FS), order 0, checkpoints kept,
# then each final checkpoint evaluated in its own plan and in BF16 as run_forward_split.sh does.
set -x
: "${FS:?set FS: the forward_split out-dir holding bases 11-14, runs/fs_plan of its worktree}"
source "$(dirname "$0")/common.sh"
SEEDS=11,12,13,14
copy_bases $FS runs/fss_plan $SEEDS
python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds $SEEDS --policies "snip" --set snip.loss_first_order=signed --out-dir runs/fss_plan --report runs/fss_plan/report.md
evaluate "checkpoint bf16" runs/fss_plan/snip_*
echo ALLDONE
