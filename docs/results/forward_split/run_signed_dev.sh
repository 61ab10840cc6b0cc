#!/bin/bash
# protocol_signed.md (registered before its runs): shipped `snip` with `snip.loss_first_order = "signed"`
# on the development bases 11-14 (copied from the forward_split out-dir $FS), order 0, checkpoints kept,
# then each final checkpoint evaluated in its own plan and in BF16 as run_forward_split.sh does.
set -x
: "${WT:?set WT: a worktree of the commit protocol_signed.md names}"
: "${FS:?set FS: the forward_split out-dir holding bases 11-14, runs/fs_plan of its worktree}"
cd $WT
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
ALL="--base-steps 1000 --steps 300 --warmup 20 --interval 100 --format-sets fp8_block,fp4_block@0.9 --rho 0.9 --continuation-schedule wsd --no-sweep --set snip.fair_share=true --set snip.granularity=gemm --eval-windows spread --eval-batches 128 --eval-interval 150 --jobs 2 --threads 1 --timeout 7200 --keep-checkpoints --continuation-order 0"
SEEDS=11,12,13,14
OUT=runs/fss_plan
mkdir -p $OUT
for s in ${SEEDS//,/ }; do
  [ -d $OUT/base_seed$s ] || { cp -r $FS/base_seed$s $OUT/; grep "\"name\": \"base_seed$s\"" $FS/results.jsonl >> $OUT/results.jsonl; }
done
python3 -m experiments.compare_policies $ALL --seeds $SEEDS --policies "snip" --set snip.loss_first_order=signed --out-dir $OUT --report $OUT/report.md
for d in $OUT/snip_*; do
  for plan in checkpoint bf16; do [ -f $d/eval_$plan.json ] || echo "$d $plan"; done
done | xargs -P 2 -L 1 sh -c 'python3 -m megatron_snip.evaluate --checkpoint $0 --plan $1 --windows spread --max-sequences 1024 --valid-corpus moby_dick=bundled:moby_dick --valid-corpus python_docs=corpus/python_docs.jsonl --out $0/eval_$1.json'
echo ALLDONE
