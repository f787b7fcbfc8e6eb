"""Time causal attention (forward + backward) on one GPU: plain SDPA per backend, and the
context-parallel path (parallelisms/context_parallel.py) for the work of one rank of a cp group.

    python benchmarks/benchmark_attention.py --seq 32768 65536 131072 --out attention.jsonl

With one GPU there is no cp group to gather from, so a cp rank's work is timed by giving it the
full K/V (what the all-gather would produce; context_parallel.WholeSequenceExchange) and running
its two query chunks, exactly as the module does (each chunk: its own keys with the causal mask
plus the keys before it unmasked, merged by log-sum-exp); `cp x rank time / plain time` near 1
means the split costs no extra attention time. The communication (an all-gather of K/V forward, a
reduce-scatter backward) is not timed here.
FLOPs: causal attention forward = 2 x 2 x seq^2 x heads x head_dim / 2; forward + backward = 3 x
forward (the convention of the model FLOPs in metrics: backward = 2 x forward).
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallelisms.context_parallel import WholeSequenceExchange, causal_chunk_attention, local_positions

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_ms(fn, repeat: int) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def print_profile(fn, label: str) -> None:
    """The GPU kernels of three calls of fn, by total time, to stderr (--profile)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"# {label}: kernels of 3 calls", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14), file=sys.stderr)


def cp_rank_inputs(q, k, v, rank: int, cp: int):
    """One cp rank's chunks of q, k, v (leaves) and its exchange holding the whole K/V."""
    positions = local_positions(k.shape[2], rank, cp).to(q.device)
    local = [t[:, :, positions].detach().requires_grad_() for t in (q, k, v)]
    return (*local, WholeSequenceExchange(torch.stack([k, v]).detach(), rank, cp))


def bench_sequence(seq: int, args: argparse.Namespace) -> list[dict]:
    shape = (1, args.heads, seq, args.head_dim)
    kv_shape = (1, args.kv_heads, seq, args.head_dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    flops = 3 * 2 * 2 * seq * seq * args.heads * args.head_dim / 2

    def plain():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    results = []
    plain_ms = {}
    for name, backend in [("default", None), *BACKENDS.items()]:
        try:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                ms = time_ms(plain, args.repeat)
        except RuntimeError as e:
            results.append({"seq": seq, "path": f"sdpa-{name}", "error": str(e).splitlines()[0][:200]})
            continue
        plain_ms[name] = ms
        if args.profile and name == "cudnn":
            with sdpa_kernel([backend]):
                print_profile(plain, f"seq {seq} sdpa-cudnn")
        results.append(
            {"seq": seq, "path": f"sdpa-{name}", "ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)}
        )
    best_plain = min(plain_ms.values())
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float()
    for cp in args.cp:
        for rank in sorted({0, cp - 1}):
            # A rank's compiled helpers (the merge, the gradients' assembly) as in its own process:
            # compiled for its shapes, not counted against the recompile limit of the ranks before.
            torch._dynamo.reset()
            positions = local_positions(seq, rank, cp).to(q.device)
            inputs = cp_rank_inputs(q, k, v, rank, cp)
            with torch.no_grad():
                out = causal_chunk_attention(*inputs).float()
            want = reference[:, :, positions]
            error = ((out - want).norm() / want.norm()).item()
            local_grad = grad[:, :, positions]
            step = lambda: causal_chunk_attention(*inputs).backward(local_grad)  # noqa: B023
            ms = time_ms(step, args.repeat)
            if args.profile:
                print_profile(step, f"seq {seq} cp{cp}-rank{rank}")
            result = {"seq": seq, "path": f"cp{cp}-rank{rank}", "ms": round(ms, 2)}
            result["tflops"] = round(flops / cp / ms / 1e9, 1)
            result["cp_x_rank_over_best_plain"] = round(cp * ms / best_plain, 3)
            result["rel_error_vs_sdpa"] = float(f"{error:.2e}")
            results.append(result)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--profile", action="store_true", help="print each path's kernels to stderr")
    args = parser.parse_args()
    torch.manual_seed(0)
    for seq in args.seq:
        for result in bench_sequence(seq, args):
            print(json.dumps(result), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
