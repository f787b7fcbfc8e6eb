#!/usr/bin/env bash
# The same benchmark on two checkouts of this repository, interleaved (before, after, before, after,
# ...) so that drift of the machine hits both alike; one JSON line per run in OUT.
#
#   git archive OLD_COMMIT | (mkdir -p /tmp/before && tar -x -C /tmp/before)
#   bash benchmarks/benchmark_before_after.sh /tmp/before out.jsonl 2 --config configs/llama3_1b.toml --steps 30
#
# Arguments: the other checkout, the output file, the number of rounds, then benchmarks/benchmark.py's
# arguments (its --config path is taken relative to each checkout).
set -euo pipefail
before=$(cd "$1" && pwd); out=$2; rounds=$3; shift 3
after=$(cd "$(dirname "$0")/.." && pwd)
for round in $(seq "$rounds"); do
    for tree in "$before" "$after"; do
        label=$([ "$tree" = "$before" ] && echo before || echo after)
        (cd "$tree" && python3 benchmarks/benchmark.py --name "$label" --out "$out" "$@") || true
    done
done
