#!/usr/bin/env bash
# Launch train.py on this node as one of NNODES nodes (run the same command on every node).
#
#   NNODES=4 NPROC_PER_NODE=8 MASTER_ADDR=node0.cluster MASTER_PORT=29500 \
#       bash scripts/multinode.sh --config configs/llama3_70b.toml --training.steps 1000
#
# torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT (a port free on that node) assigns ranks,
# so nodes may start in any order; every argument is passed to train.py. Set RDZV_ID to tell
# concurrent jobs apart (default: the Slurm job id, else "recipe").
#
# To stop (preemption): SIGTERM or SIGUSR1 to this script's process (it becomes the launcher) or to
# the workers; they finish the step, save a checkpoint, and the script exits 0. torchrun itself
# would exit 1 after SIGTERM and die from SIGUSR1: scripts/torchrun_with_stop_signals.py says why.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR}"
exec python scripts/torchrun_with_stop_signals.py \
    --nnodes "$NNODES" \
    --nproc-per-node "${NPROC_PER_NODE:-gpu}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-recipe}}" \
    train.py "$@"
