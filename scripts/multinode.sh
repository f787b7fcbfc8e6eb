#!/usr/bin/env bash
# Launch train.py on this node as one of NNODES nodes (run the same command on every node).
#
#   NNODES=4 NPROC_PER_NODE=8 MASTER_ADDR=node0.cluster MASTER_PORT=29500 \
#       bash scripts/multinode.sh --config configs/llama3_70b.toml --training.steps 1000
#
# torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT (a port free on that node) assigns ranks,
# so nodes may start in any order; every argument is passed to train.py. Set RDZV_ID to tell
# concurrent jobs apart (default: the Slurm job id, else "recipe").
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR}"
exec torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "${NPROC_PER_NODE:-gpu}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-recipe}}" \
    train.py "$@"
