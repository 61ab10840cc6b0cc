#!/bin/bash
# Where each plan's gap to BF16 lies at 1.66M (protocol.md, registered before its runs): the arms of
# ../goal_1x/ (BF16, uniform `fp4_block`, shipped `snip`; `tail+switch`, `snip+switch` under the run
# budget) on development bases 11-14, data order 0, each run's final checkpoint kept; then every final
# checkpoint is evaluated again on the same 1,024 spread windows per domain, once in its own plan (a
# check: it must give the run's recorded final losses) and once with every GEMM in BF16.
# Resumable: compare_policies skips the runs an out-dir's results.jsonl holds; an evaluation is
# skipped when its JSON exists.
set -x
: "${WT:?set WT: a worktree of the commit protocol.md names}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 150 --jobs 2 --threads 1 --timeout 7200 --keep-checkpoints --continuation-order 0"
SEEDS=11,12,13,14
python3 -m experiments.compare_policies $ALL --seeds $SEEDS --policies "bf16;uniform:fp4_block;snip" --out-dir runs/fs_plan --report runs/fs_plan/report.md
mkdir -p runs/fs_run
for s in ${SEEDS//,/ }; do
  [ -d runs/fs_run/base_seed$s ] || { cp -r runs/fs_plan/base_seed$s runs/fs_run/; grep "\"name\": \"base_seed$s\"" runs/fs_plan/results.jsonl >> runs/fs_run/results.jsonl; }
done
python3 -m experiments.compare_policies $ALL --seeds $SEEDS --policies "tail+switch;snip+switch" --set snip.budget=run --out-dir runs/fs_run --report runs/fs_run/report.md
# Every continuation's final checkpoint, in its own plan and in BF16 (two at a time, one thread each).
for d in runs/fs_plan/*_seed* runs/fs_run/*_seed*; do
  case $d in */base_seed*) continue;; esac
  for plan in checkpoint bf16; do
    [ -f $d/eval_$plan.json ] || echo "$d $plan"
  done
done | xargs -P 2 -L 1 sh -c 'python3 -m megatron_snip.evaluate --checkpoint $0 --plan $1 --windows spread --max-sequences 1024 --valid-corpus moby_dick=bundled:moby_dick --valid-corpus python_docs=corpus/python_docs.jsonl --out $0/eval_$1.json'
echo ALLDONE
