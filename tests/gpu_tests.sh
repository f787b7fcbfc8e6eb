#!/usr/bin/env bash
# The multi-GPU suite (tests/test_gpu.py) on this machine's GPUs: every layout that fits, against one
# GPU. Results: a JSON line per run in ${GPU_RESULTS:-gpu_results.jsonl}, and pytest's summary.
#
#   bash tests/gpu_tests.sh                 # all tests that fit the GPUs here
#   bash tests/gpu_tests.sh -k tp2          # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"  # NVLink multicast off (shared hosts)
export GPU_RESULTS="${GPU_RESULTS:-$PWD/gpu_results.jsonl}"
echo "$(date -u +%FT%TZ) commit ${GPU_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}," \
     "torch $(python3 -c 'import torch; print(torch.__version__)'), $(nvidia-smi -L | wc -l) GPUs" >&2
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -rs "$@"
