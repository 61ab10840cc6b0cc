#!/bin/bash
# Copy run.sh's records from its worktree ($WT) into this folder as they finish: each out-dir's
# results.jsonl, every plan of every new run (plans/o<k>_<run>_step_<N>.json), and each evaluation with
# the plan in force at the end (evals_new/ for runs/f8_o<k>, evals_ref/ for runs/f8r_o<k>:
# o<k>_<run>_{checkpoint,bf16,plan}.json), of finished runs only. Safe to rerun: it overwrites with the same files.
set -e
: "${WT:?set WT: the worktree run.sh runs in}"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p $HERE/plans $HERE/evals_new $HERE/evals_ref
for k in 0 1 2 3; do
  for kind in f8 f8r; do
    out=$WT/runs/${kind}_o$k
    [ -f $out/results.jsonl ] || continue
    cp $out/results.jsonl $HERE/results_${kind}_o$k.jsonl
    evals=$HERE/evals_new; [ $kind = f8r ] && evals=$HERE/evals_ref
    for d in $out/*_seed*; do
      run=$(basename $d)
      case $run in base_seed*) continue;; esac
      grep -q "\"name\": \"$run\"" $out/results.jsonl || continue  # finished runs only
      [ $kind = f8 ] && for p in $d/plans/step_??????.json; do cp $p $HERE/plans/o${k}_${run}_$(basename $p); done
      for e in $d/eval_*.json; do [ -f $e ] && cp $e $evals/o${k}_${run}_$(basename $e .json | sed 's/^eval_//').json; done
      last=$(ls $d/plans/step_??????.json | tail -1)
      [ $k -le 1 ] && cp $last $evals/o${k}_${run}_plan.json
    done
  done
done
