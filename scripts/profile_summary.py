"""Where a profiled step's GPU time goes: kernel time by kind, the top kernels, and the idle gaps.

    python scripts/profile_summary.py profiles/rank0_step12-13.json.gz [--steps 2] [--top 20]

Reads a trace written by `[profiling]` (or scripts/benchmark.py --profile-dir) and prints a table
per step: matmul, attention, optimizer, NCCL, copies, compiled element-wise (Triton) and other
kernels, with the time the GPU was idle between kernels over the traced span.
"""

import argparse
import collections
import gzip
import json
import sys

KINDS = [  # first match wins; names as CUDA kernels are called in torch 2.11 traces on the H200
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "matmul", "grouped_mm")),
    ("triton", ("triton",)),
    ("copy", ("memcpy", "memset", "copy", "cat")),
]


def kind(name: str) -> str:
    lower = name.lower()
    for label, needles in KINDS:
        if any(needle in lower for needle in needles):
            return label
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=2, help="steps the trace spans (default: %(default)s)")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        sys.exit(f"error: {args.trace} has no GPU kernels")
    by_kind, by_name = collections.Counter(), collections.Counter()
    calls = collections.Counter()
    for e in kernels:
        by_kind[kind(e["name"])] += e["dur"]
        by_name[e["name"][:110]] += e["dur"]
        calls[e["name"][:110]] += 1
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = busy_time([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    per_step = 1000.0 * args.steps  # trace microseconds -> ms per step
    idle = span - busy
    print(f"traced {span / per_step:.1f} ms/step: GPU busy {busy / per_step:.1f}, idle {idle / per_step:.1f}")
    print("| kind | ms/step | share of busy |\n| --- | --- | --- |")
    for label, total in by_kind.most_common():
        print(f"| {label} | {total / per_step:.1f} | {100 * total / busy:.0f}% |")
    print(f"\ntop {args.top} kernels (ms/step, calls/step):")
    for name, total in by_name.most_common(args.top):
        print(f"{total / per_step:8.2f} {calls[name] / args.steps:6.0f}  [{kind(name)}] {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
