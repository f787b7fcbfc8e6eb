"""One MoE layer on one GPU, apart from the model: the grouped expert GEMMs alone, the experts'
SwiGLU, and the whole layer (route, dispatch, experts, combine, balance loss), eager and compiled,
forward + backward. Prints one JSON line per measurement: ms per call and, for the GEMMs, TFLOP/s.

    python benchmarks/benchmark_moe.py                       # Qwen3-30B-A3B's layer, 8192 tokens
    python benchmarks/benchmark_moe.py --tokens 16384 --experts 64

With the step time of benchmarks/benchmark.py on the 4-layer cut (docs/moe.md) this gives the MoE
layers' share of the step: n_layers x the compiled layer's ms / step ms.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.grouped_experts import expert_swiglu
from models.moe import MoE, MoEArgs


def timed_ms(action, repeats: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for _ in range(3):  # warm-up (and compilation)
        action()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        action()
    sync()
    return (time.perf_counter() - start) * 1e3 / repeats


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per layer call (batch x seq)")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-hidden-dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = "cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16  # (cpu: to try it)
    rows, dim, width, n = args.tokens * args.top_k, args.dim, args.expert_hidden_dim, args.experts
    results = []

    def report(name: str, ms: float, flops: float = 0.0) -> None:
        result = {"measure": name, "ms": round(ms, 3), "rows": rows, "experts": n, "dim": dim, "width": width}
        if flops:
            result["tflop_s"] = round(flops / ms / 1e9, 1)
        results.append(result)
        print(json.dumps(result), flush=True)

    # Routed rows as a balanced router would send them: a random top-k choice per token.
    choices = torch.rand(args.tokens, n, device=device).topk(args.top_k, dim=1).indices.flatten()
    tokens_per_expert = torch.bincount(choices, minlength=n)
    ends = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    x = torch.randn(rows, dim, device=device, dtype=dtype, requires_grad=True)
    weights = [
        (torch.randn(n, *shape, device=device, dtype=dtype) * 0.02).requires_grad_()
        for shape in ((dim, width), (width, dim), (dim, width))
    ]
    w1, w2, w3 = weights
    gemm_flops = 3 * 3 * 2 * rows * dim * width  # three GEMMs, forward + two backward GEMMs each

    def gemms_alone() -> None:
        a, b = torch._grouped_mm(x, w1, offs=ends), torch._grouped_mm(x, w3, offs=ends)
        hidden = (a * b).detach().requires_grad_()  # (the SwiGLU product apart: GEMMs only)
        out = torch._grouped_mm(hidden, w2, offs=ends)
        torch.autograd.backward([out, a, b], [torch.ones_like(out), torch.ones_like(a), torch.ones_like(b)])

    report("grouped GEMMs alone, fwd+bwd", timed_ms(gemms_alone, args.repeats), gemm_flops)
    swiglu = lambda: expert_swiglu(x, tokens_per_expert, w1, w2, w3).sum().backward()
    report("experts' SwiGLU (expert_swiglu), fwd+bwd", timed_ms(swiglu, args.repeats), gemm_flops)

    moe = MoE(dim, MoEArgs(n_experts=n, top_k=args.top_k, expert_hidden_dim=width, aux_loss_coeff=1e-3))
    moe.init_weights()
    moe = moe.to(device=device, dtype=dtype)
    moe.expert_bias.data = moe.expert_bias.float()
    moe.train()
    hidden = torch.randn(1, args.tokens, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(hidden)
    layer = lambda module: lambda: module(hidden).backward(grad)
    report("MoE layer eager, fwd+bwd", timed_ms(layer(moe), args.repeats), gemm_flops)
    report(
        "MoE layer compiled, fwd+bwd",
        timed_ms(layer(torch.compile(moe, fullgraph=True)), args.repeats),
        gemm_flops,
    )
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
