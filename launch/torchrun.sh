#!/usr/bin/env bash
# Single-node launcher: N processes on this machine, config + train.py arguments passed through.
#
#   launch/torchrun.sh 4 launch/configs/tiny.toml --set parallel.tp=2 --set parallel.pp=2
#   NPROC=8 launch/torchrun.sh launch/configs/llama_1b.toml --set training.max_steps=100
#
# N is the first argument when it is a number, else $NPROC (default 1). Everything after the
# config goes to `python -m megatron_snip.train` unchanged, after `--set training.resume=auto`
# (a rerun of the same command continues the run; pass --set training.resume=false to refuse
# an existing run directory). MAX_RESTARTS (default 0) is torchrun's --max-restarts: failed
# workers are restarted and resume from the latest verified checkpoint. No hyperparameters live here.
set -euo pipefail

if [[ $# -ge 1 && $1 =~ ^[0-9]+$ ]]; then
    NPROC=$1
    shift
fi
NPROC=${NPROC:-1}
if [[ ! $NPROC =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC=$NPROC must be a positive integer (processes on this node)" >&2
    exit 2
fi
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [[ ! $MAX_RESTARTS =~ ^[0-9]+$ ]]; then
    echo "error: MAX_RESTARTS=$MAX_RESTARTS must be a non-negative integer (torchrun --max-restarts)" >&2
    exit 2
fi
if [[ $# -lt 1 ]]; then
    echo "usage: $0 [NPROC] CONFIG [--set section.field=value ...]" >&2
    exit 2
fi
CONFIG=$1
shift

# --standalone: a private c10d rendezvous on localhost with a free port (one node only).
exec torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" --max-restarts="$MAX_RESTARTS" \
    -m megatron_snip.train --config "$CONFIG" --set training.resume=auto "$@"
