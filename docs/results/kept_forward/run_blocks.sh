#!/bin/bash
# protocol_blocks.md (registered before its evaluations): kept1's final checkpoints (runs/kf1_plan) in
# their last plan cut to each block's forward GEMMs, and tail+switch's (forward_split's, $FSR = its
# runs/fs_run) in blocks 0-3's cuts of its own; each result in eval_block_<b>.json of the run.
set -x
: "${WT:?set WT: the worktree of this study, holding runs/kf1_plan}"
: "${FSR:?set FSR: the forward_split out-dir holding the tail+switch runs, runs/fs_run of its worktree}"
HERE=$(cd "$(dirname "$0")" && pwd)  # this folder of the registering commit (block_plans.py)
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
for s in 11 12 13 14; do
  for d in runs/kf1_plan/snip_fp8_block-fp4_block_rho0.9_seed$s $FSR/tail-switch_fp8_block-fp4_block_rho0.9_seed$s; do
    [ -d $d/block_plans ] || python3 $HERE/block_plans.py $d $d/block_plans
    blocks="0 1 2 3 4 5 6 7"; case $d in *tail-switch*) blocks="0 1 2 3";; esac
    for b in $blocks; do [ -f $d/eval_block_$b.json ] || echo "$d $b"; done
  done
done | xargs -P 2 -L 1 sh -c 'python3 -m megatron_snip.evaluate --checkpoint $0 --plan $0/block_plans/block_$1.json --windows spread --max-sequences 1024 --valid-corpus moby_dick=bundled:moby_dick --valid-corpus python_docs=corpus/python_docs.jsonl --out $0/eval_block_$1.json'
echo ALLDONE
