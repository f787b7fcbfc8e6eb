"""Where a profiled step's GPU time goes: kernel time by kind, the top kernels, and the idle gaps.

    python scripts/profile_summary.py profiles/rank0_step12-13.json.gz [--steps 2] [--top 20]

Reads a trace written by `[profiling]` (or benchmarks/benchmark.py --profile-dir) and prints a table
per step: matmul, attention, optimizer, NCCL, copies, compiled element-wise (Triton) and other
kernels, with the time the GPU was idle between kernels over the traced span.

--inductor-code DIR adds the bytes each compiled (Triton) kernel moves and the bandwidth it
reached, read from the code inductor generated in DIR when the traced run had
TORCHINDUCTOR_CACHE_DIR=DIR TORCHINDUCTOR_BENCHMARK_KERNEL=1 (the kernels' `kernel_num_gb`: every
input and output counted once). A kernel far below the card's ~4 TB/s is worth reading there.

--gaps N lists the N longest idle gaps: the kernels before and after, how late the host launched
the kernel after (a launch inside the gap: the GPU waited for the host), and what the host was
running when it launched it (the annotations and the innermost operator around the launch).
"""

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys

KINDS = [  # first match wins; names as CUDA kernels are called in torch 2.11 traces on the H200
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "matmul", "grouped_mm")),
    ("triton", ("triton",)),
    ("copy", ("memcpy", "memset", "copy", "cat")),
]
NAME_LENGTH = 110  # kernel names are cut to this in the tables


def kind(name: str) -> str:
    lower = name.lower()
    for label, needles in KINDS:
        if any(needle in lower for needle in needles):
            return label
    return "other"


def triton_kernel_gigabytes(code_dir: str) -> dict[str, set[float]]:
    """Kernel name -> the GB inductor counted for it, over every generated module in code_dir
    (one name can stand for different kernels in different graphs: then there are several)."""
    sizes = collections.defaultdict(set)
    definition = re.compile(r"^(triton_\w+) = async_compile\.triton\(", re.M)
    for path in pathlib.Path(code_dir).rglob("*.py"):
        text = path.read_text(errors="replace")
        starts = list(definition.finditer(text)) + [None]
        for start, end in zip(starts, starts[1:]):
            body = text[start.start() : end.start() if end else len(text)]
            found = re.search(r"'kernel_num_gb': ([0-9.e-]+)", body)
            if found:
                sizes[start.group(1)].add(float(found.group(1)))
    return sizes


def bandwidth_note(name: str, ms_per_call: float, sizes: dict[str, set[float]]) -> str:
    truncated = len(name) == NAME_LENGTH
    same = [gbs for kernel, gbs in sizes.items() if kernel == name or (truncated and kernel.startswith(name))]
    matches = set().union(*same)
    if len(matches) != 1:
        return "  (bytes unknown)" if not matches else "  (several kernels by this name)"
    (gigabytes,) = matches
    return f"  {gigabytes:.3f} GB, {gigabytes / ms_per_call:.2f} TB/s"


def host_context(events: list[dict], launch: dict) -> str:
    """The host's annotations and innermost operator on the launching thread around `launch`."""
    around = [
        e for e in events
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("tid") == launch.get("tid")
        and e["ts"] <= launch["ts"] <= e["ts"] + e.get("dur", 0)
    ]  # fmt: skip
    around.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))  # outermost first
    names = [e["name"] for e in around if e.get("cat") == "user_annotation"]
    ops = [e["name"] for e in around if e.get("cat") == "cpu_op"]
    return " > ".join(names + ops[-1:]) or "(nothing recorded)"


def idle_gaps(kernels: list[dict]) -> list[tuple[float, float, dict, dict]]:
    """Every stretch with no GPU work between the first kernel and the last: (length, start, the
    kernel that ended last before it, the kernel after it), in trace order."""
    gaps, busy_until, last = [], None, None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        if busy_until is not None and e["ts"] > busy_until:
            gaps.append((e["ts"] - busy_until, busy_until, last, e))
        if busy_until is None or e["ts"] + e["dur"] > busy_until:
            busy_until, last = e["ts"] + e["dur"], e
    return gaps


def describe_gaps(events: list[dict], gaps: list[tuple[float, float, dict, dict]], count: int) -> list[str]:
    """The `count` longest gaps, longest first, as printable lines."""
    launches = {
        e["args"]["correlation"]: e for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }  # fmt: skip
    lines = []
    for length, start, before, after in sorted(gaps, key=lambda g: g[0], reverse=True)[:count]:
        launch = launches.get(after.get("args", {}).get("correlation"))
        when = (
            f"launched {(launch['ts'] - start) / 1000:+.3f} ms into the gap" if launch else "launch not found"
        )
        lines.append(
            f"{length / 1000:7.3f} ms  after {before['name'][:50]}  before {after['name'][:50]}\n"
            f"           {when}; host: {host_context(events, launch)[:200] if launch else '-'}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=2, help="steps the trace spans (default: %(default)s)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--inductor-code", help="inductor's cache dir of the traced run (see above)")
    parser.add_argument("--gaps", type=int, default=0, help="list the N longest idle gaps (see above)")
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
        by_name[e["name"][:NAME_LENGTH]] += e["dur"]
        calls[e["name"][:NAME_LENGTH]] += 1
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    gaps = idle_gaps(kernels)
    idle = sum(gap[0] for gap in gaps)
    busy = span - idle
    per_step = 1000.0 * args.steps  # trace microseconds -> ms per step
    print(f"traced {span / per_step:.1f} ms/step: GPU busy {busy / per_step:.1f}, idle {idle / per_step:.1f}")
    print("| kind | ms/step | share of busy |\n| --- | --- | --- |")
    for label, total in by_kind.most_common():
        print(f"| {label} | {total / per_step:.1f} | {100 * total / busy:.0f}% |")
    print(f"\ntop {args.top} kernels (ms/step, calls/step):")
    sizes = triton_kernel_gigabytes(args.inductor_code) if args.inductor_code else None
    for name, total in by_name.most_common(args.top):
        line = f"{total / per_step:8.2f} {calls[name] / args.steps:6.0f}  [{kind(name)}] {name}"
        if sizes is not None and kind(name) == "triton":
            line += bandwidth_note(name, total / 1000.0 / calls[name], sizes)  # trace us -> ms per call
        print(line)
    if args.gaps:
        print(f"\nlongest {args.gaps} idle gaps:")
        print("\n".join(describe_gaps(events, gaps, args.gaps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
