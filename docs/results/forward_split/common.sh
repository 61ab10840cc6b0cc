# Sourced by this folder's drivers (run_*.sh): into the worktree $WT, ../goal_1x/'s flags (1.66M `tiny`,
# 1,000-step BF16 bases, 300 WSD steps, policy at step 20, re-plans every 100, rho = 0.9 on
# fp8_block,fp4_block, per GEMM, fair_share, 1,024 spread windows per domain) with each run's final
# checkpoint kept, and the two steps the drivers share.
: "${WT:?set WT: a worktree of the commit named by the protocol of the driver}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 150 --jobs 2 --threads 1 --timeout 7200 --keep-checkpoints"

copy_bases() {  # $1 = the out-dir holding the bases, $2 = an out-dir, $3 = comma-separated seeds
  mkdir -p $2
  for s in ${3//,/ }; do
    [ -d $2/base_seed$s ] || { cp -r $1/base_seed$s $2/; grep "\"name\": \"base_seed$s\"" $1/results.jsonl >> $2/results.jsonl; }
  done
}

evaluate() {  # $1 = the plans ("checkpoint bf16"), then run directories (bases skipped): each final
  # checkpoint in each plan on the runs' windows, two at a time, one thread each; a JSON on file is kept
  local plans=$1; shift
  for d in "$@"; do
    case $d in */base_seed*) continue;; esac
    for plan in $plans; do [ -f $d/eval_$plan.json ] || echo "$d $plan"; done
  done | xargs -P 2 -L 1 sh -c 'python3 -m megatron_snip.evaluate --checkpoint $0 --plan $1 --windows spread --max-sequences 1024 --valid-corpus moby_dick=bundled:moby_dick --valid-corpus python_docs=corpus/python_docs.jsonl --out $0/eval_$1.json'
}
