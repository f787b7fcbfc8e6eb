#!/usr/bin/env bash
# Fault tolerance on one machine: torchft's lighthouse and REPLICA_GROUPS replica groups of
# NPROC_PER_GROUP processes each (GPUs split between the groups when there are GPUs). A group that
# fails is started again (up to RESTARTS times): it copies the live state from a peer and goes on.
# The lighthouse too is started again when it dies (up to RESTARTS times): the groups wait for it
# (fault_tolerance.timeout_seconds), then go on; groups that stopped meanwhile are started again.
#
#   REPLICA_GROUPS=2 NPROC_PER_GROUP=4 bash scripts/fault_tolerance_local.sh --config configs/llama3_8b.toml
#
# Every argument is passed to train.py, with --fault_tolerance.enable, replica_id and group_size
# added. Each group is its own torchrun job (port 29600 + replica id); its records go to
# <dump_folder>/replica_<id>/, its log to <dump_folder>/replica_<id>.log (the lighthouse's to
# lighthouse.log). HEARTBEAT_MS: how long the lighthouse waits for a silent group before the others
# go on without it (default 5000); MIN_REPLICAS: groups needed to form a quorum (default 1: a group
# that is up first trains alone, the others copy its state when they join).
# Across machines, and under Slurm, see docs/fault_tolerance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
groups=${REPLICA_GROUPS:-2} nproc=${NPROC_PER_GROUP:-1} restarts=${RESTARTS:-3}
port=${LIGHTHOUSE_PORT:-29510}
# Numbers only: bash arithmetic ($((...))) would evaluate anything else as code.
for number in "$groups" "$nproc" "$restarts" "$port"; do
    if [[ ! $number =~ ^[0-9]+$ ]]; then
        echo "error: REPLICA_GROUPS, NPROC_PER_GROUP, RESTARTS and LIGHTHOUSE_PORT must be whole numbers (got '$number')" >&2
        exit 2
    fi
done
folder=$(python -c "import sys
from configs import UserError, load_config
try:
    print(load_config(sys.argv[1:]).job.dump_folder)
except UserError as e:
    sys.exit(f'error: {e}')" "$@") || exit 2
mkdir -p -- "$folder"

keep_lighthouse() {
    local attempt child=""
    trap 'kill "$child" 2>/dev/null; exit' TERM
    for attempt in $(seq 0 "$restarts"); do
        if [ "$attempt" -gt 0 ]; then
            echo "lighthouse: restart $attempt" >&2
            sleep 1  # its port free again
        fi
        torchft_lighthouse --min_replicas "${MIN_REPLICAS:-1}" --quorum_tick_ms 100 --join_timeout_ms 10000 \
            --heartbeat_timeout_ms "${HEARTBEAT_MS:-5000}" --bind "[::]:$port" >>"$folder/lighthouse.log" 2>&1 &
        child=$!
        wait "$child"
    done
}
: >"$folder/lighthouse.log"
keep_lighthouse &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null; kill 0 2>/dev/null' EXIT
export TORCHFT_LIGHTHOUSE="http://localhost:$port"

run_group() {
    local id=$1 attempt
    shift
    if command -v nvidia-smi >/dev/null; then
        export CUDA_VISIBLE_DEVICES=$(seq -s, $((id * nproc)) $((id * nproc + nproc - 1)))
    fi
    for attempt in $(seq 0 "$restarts"); do
        [ "$attempt" -gt 0 ] && echo "replica group $id: restart $attempt" >&2
        torchrun --nproc-per-node "$nproc" --master-addr localhost --master-port $((29600 + id)) \
            train.py "$@" --fault_tolerance.enable --fault_tolerance.replica_id "$id" \
            --fault_tolerance.group_size "$groups" >>"$folder/replica_$id.log" 2>&1 && return 0
    done
    return 1
}

pids=()
for id in $(seq 0 $((groups - 1))); do
    run_group "$id" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
trap - EXIT
kill "$lighthouse" 2>/dev/null
exit "$status"
