#!/bin/bash
# Where each plan's gap to BF16 lies at 1.66M (protocol.md, registered before its runs): the arms of
# ../goal_1x/ (BF16, uniform `fp4_block`, shipped `snip`; `tail+switch`, `snip+switch` under the run
# budget) on development bases 11-14, data order 0, each run's final checkpoint kept; then every final
# checkpoint is evaluated again on the same 1,024 spread windows per domain, once in its own plan (a
# check: it must give the run's recorded final losses) and once with every GEMM in BF16.
# Resumable: compare_policies skips the runs an out-dir's results.jsonl holds; an evaluation is
# skipped when its JSON exists.
set -x
source "$(dirname "$0")/common.sh"
SEEDS=11,12,13,14
python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds $SEEDS --policies "bf16;uniform:fp4_block;snip" --out-dir runs/fs_plan --report runs/fs_plan/report.md
copy_bases runs/fs_plan runs/fs_run $SEEDS
python3 -m experiments.compare_policies $ALL --continuation-order 0 --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --out-dir runs/fs_run --report runs/fs_run/report.md
evaluate "checkpoint bf16" runs/fs_plan/*_seed* runs/fs_run/*_seed*
echo ALLDONE
