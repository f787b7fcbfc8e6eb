#!/usr/bin/env bash
# One run of benchmarks/benchmark.py whose every logged step (loss / gradient norm) is appended to a
# file as one line, to compare runs step by step. STRICT=1 runs it under torch's strict determinism
# (torch.use_deterministic_algorithms(True), cuBLAS's fixed workspace): two such runs of the same
# code must log equal numbers to the last bit, so a difference is a race or an unflagged atomic sum.
# (Python imports only the first sitecustomize.py on its path: STRICT=1 hides one that PYTHONPATH
# already names, such as benchmarks/inductor_experiments'.)
#
#   STRICT=1 bash benchmarks/benchmark_repeatability.sh strict_1 losses.txt --config configs/llama3_1b.toml \
#       --steps 14 --warmup 7 -- --float8.enable true
#
# Arguments: the run's name, the file to append to, then benchmarks/benchmark.py's arguments.
set -euo pipefail
name=$1; out=$2; shift 2
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ "${STRICT:-0}" = 1 ]; then
    printf 'import torch\ntorch.use_deterministic_algorithms(True)\n' > "$tmp/sitecustomize.py"
    export PYTHONPATH="$tmp${PYTHONPATH:+:$PYTHONPATH}" CUBLAS_WORKSPACE_CONFIG=:4096:8
fi
# benchmark.py's options must come before its `--`: put ours first
python3 benchmarks/benchmark.py --name "$name" --log-freq 1 --keep-metrics "$tmp/metrics.jsonl" "$@"
python3 - "$name" "$tmp/metrics.jsonl" >> "$out" <<'PY'
import json
import sys

name, path = sys.argv[1:]
steps = [json.loads(line) for line in open(path)]
print(name, " ".join(f"{s['step']}:{s['loss']!r}/{s['grad_norm']!r}" for s in steps if "loss" in s))
PY
