#!/bin/bash
# protocol_cross.md (registered before its evaluations): each development run's final checkpoint (bases
# 11-14, order 0, arms snip, tail+switch, snip+switch of forward_split's out-dirs) evaluated in the other
# arms' last plans, on the runs' windows; each result in eval_in_<arm>.json of the evaluated run.
set -x
: "${WT:?set WT: the forward_split worktree holding runs/fs_plan and runs/fs_run}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
run_dir() {  # $1 = arm, $2 = base seed
  case $1 in
    snip) echo runs/fs_plan/snip_fp8_block-fp4_block_rho0.9_seed$2;;
    *) echo runs/fs_run/${1}_fp8_block-fp4_block_rho0.9_seed$2;;
  esac
}
for s in 11 12 13 14; do
  for w in snip tail-switch snip-switch; do
    for p in snip tail-switch snip-switch; do
      [ $w = $p ] && continue
      d=$(run_dir $w $s); plan=$(ls $(run_dir $p $s)/plans/step_*[0-9].json | tail -1)
      [ -f $d/eval_in_$p.json ] || echo "$d $plan $p"
    done
  done
done | xargs -P 2 -L 1 sh -c 'python3 -m megatron_snip.evaluate --checkpoint $0 --plan $1 --windows spread --max-sequences 1024 --valid-corpus moby_dick=bundled:moby_dick --valid-corpus python_docs=corpus/python_docs.jsonl --out $0/eval_in_$2.json'
echo ALLDONE
