#!/bin/bash
# Copy run.sh's records from its worktree ($WT) into this folder as they finish: the check's out-dir's
# results.jsonl (results_check.jsonl), each order's (results_oc_o<k>.jsonl) and every plan of every finished
# new run (plans/o<k>_<run>_step_<N>.json). Safe to rerun: it overwrites with the same files.
set -e
: "${WT:?set WT: the worktree run.sh runs in}"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p $HERE/plans
[ -f $WT/runs/pc4_plan/results.jsonl ] && cp $WT/runs/pc4_plan/results.jsonl $HERE/results_check.jsonl
for k in 0 1 2 3 4; do
  out=$WT/runs/oc_o$k
  [ -f $out/results.jsonl ] || continue
  cp $out/results.jsonl $HERE/results_oc_o$k.jsonl
  for d in $out/snip_*; do
    [ -d $d ] || continue
    run=$(basename $d)
    grep -q "\"name\": \"$run\"" $out/results.jsonl || continue  # finished runs only
    for p in $d/plans/step_??????.json; do cp $p $HERE/plans/o${k}_${run}_$(basename $p); done
  done
done
