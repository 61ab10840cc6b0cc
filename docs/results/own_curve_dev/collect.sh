#!/bin/bash
# Copy run.sh's records from its worktree ($WT) into this folder as they finish: each out-dir's results.jsonl
# (runs/pc4_plan as results_ocp_o0.jsonl, runs/<kind>_o<k> as results_<kind>_o<k>.jsonl) and every plan of
# every finished continuation (plans/<kind>_o<k>_<run>_step_<N>.json). Safe to rerun: it overwrites with the
# same files.
set -e
: "${WT:?set WT: the worktree run.sh runs in}"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p $HERE/plans
for pair in pc4_plan:ocp_o0 ocp_o1 ocr_o0 ocr_o1 oc_o0 oc_o1; do  # order 0's `snip` is step 1's out-dir
  out=$WT/runs/${pair%%:*} name=${pair##*:}
  [ -f $out/results.jsonl ] || continue
  cp $out/results.jsonl $HERE/results_$name.jsonl
  for d in $out/*_seed*; do
    run=$(basename $d)
    case $run in base_seed*) continue;; esac
    grep -q "\"name\": \"$run\"" $out/results.jsonl || continue  # finished runs only
    for p in $d/plans/step_??????.json; do cp $p $HERE/plans/${name}_${run}_$(basename $p); done
  done
done
