"""Time a block's input projections forward + backward: Q, K, V and the feed-forward's gate and up
projections as separate matmuls (as the models have them) against one fused matmul each.

Predicts what fusing the weights would gain before changing any model: the fused product has the
same FLOPs but one larger N (e.g. 2048 + 512 + 512 for the 1B's Q/K/V, whose K and V products are
narrow). bf16 weights and activations, input gradient included; the kernels' GPU time per call (profiler),
mean of --repeat calls after warm-up.

With --float8 the projections are torchao's Float8Linear (tensorwise, as `[float8] enable`) behind
the block's RMSNorm, float32 weights under bf16 autocast and compiled, as one GPU trains them, so the
time includes the float8 casts: the shared input is cast once per fused matmul, and once per matmul
when separate unless the compiler shares the cast.

    python3 benchmarks/benchmark_projections.py --dim 2048 --q 2048 --kv 512 --ffn 8192 --tokens 8192
    python3 benchmarks/benchmark_projections.py --dim 3072 --q 3072 --kv 1024 --ffn 8192 --tokens 16384 \\
        --float8
"""

import argparse
import json
import sys

import torch
from torch import nn


def kernel_ms(fn, repeat: int) -> float:
    """GPU time of fn's kernels per call (the profiler's sum): the small products finish faster
    than Python launches them, so wall-clock time would measure the launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3 / repeat


def forward_backward(x: torch.Tensor, weights: list[torch.Tensor], grads: list[torch.Tensor]):
    """x @ w.T for each weight, then the backward of their sum against the given output gradients."""
    outs = [x @ w.t() for w in weights]
    torch.autograd.backward(outs, grads)


class NormAndProjections(nn.Module):
    """RMSNorm, then one Linear per width (bias-free, as in the models)."""

    def __init__(self, dim: int, widths: list[int]):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.projections = nn.ModuleList(nn.Linear(dim, n, bias=False) for n in widths)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        normed = self.norm(x)
        return [projection(normed) for projection in self.projections]


def measure_float8(dim: int, widths: list[int], tokens: int, repeat: int) -> dict:
    """Float8Linear projections behind RMSNorm, compiled, forward + backward (input gradient too);
    float32 weights under bf16 autocast, as an unwrapped model trains on one GPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flop = 6 * tokens * dim * sum(widths)
    row = {"dim": dim, "widths": widths, "tokens": tokens, "float8": "tensorwise"}
    for name, layout in (("separate", widths), ("fused", [sum(widths)])):
        module = NormAndProjections(dim, layout).to(device="cuda")
        convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        module.compile()
        grads = [torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) for n in layout]

        def step(m=module, g=grads):
            m.zero_grad(set_to_none=True)  # as the training step: no accumulation into .grad
            with torch.autocast("cuda", torch.bfloat16):
                outs = m(x)
            torch.autograd.backward(outs, g)

        ms = kernel_ms(step, repeat)
        row[f"{name}_ms"] = round(ms, 3)
        row[f"{name}_tflops"] = round(flop / ms / 1e9, 1)
    return row


def measure(dim: int, widths: list[int], tokens: int, repeat: int) -> dict:
    device, dtype = "cuda", torch.bfloat16
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    separate = [torch.randn(n, dim, device=device, dtype=dtype, requires_grad=True) for n in widths]
    fused = [torch.randn(sum(widths), dim, device=device, dtype=dtype, requires_grad=True)]
    flop = 6 * tokens * dim * sum(widths)
    row = {"dim": dim, "widths": widths, "tokens": tokens}
    for name, weights in (("separate", separate), ("fused", fused)):
        grads = [torch.randn(tokens, w.shape[0], device=device, dtype=dtype) for w in weights]
        ms = kernel_ms(lambda w=weights, g=grads: forward_backward(x, w, g), repeat)
        row[f"{name}_ms"] = round(ms, 3)
        row[f"{name}_tflops"] = round(flop / ms / 1e9, 1)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--q", type=int, required=True, help="query projection width (heads x head dim)")
    parser.add_argument("--kv", type=int, required=True, help="key (= value) projection width")
    parser.add_argument("--ffn", type=int, required=True, help="feed-forward hidden width")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--float8", action="store_true", help="torchao Float8Linear behind RMSNorm, compiled")
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()
    timed = measure_float8 if args.float8 else measure
    rows = [
        {"projection": "qkv", **timed(args.dim, [args.q, args.kv, args.kv], args.tokens, args.repeat)},
        {"projection": "gate_up", **timed(args.dim, [args.ffn, args.ffn], args.tokens, args.repeat)},
    ]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
