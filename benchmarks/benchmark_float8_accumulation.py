"""Time a decoder layer's float8 products with cuBLAS's fast accumulation on and off: what would
the backward products gain from it?

torchao's tensorwise recipe (`[float8] enable`) runs the forward product with fast accumulation
(`use_fast_accum=True`: the tensor cores' own accumulator, no periodic promotion to float32) and
the two backward products (input gradient dY @ W, weight gradient dY^T @ x) without it, for
accuracy. Every float8 product of one layer (the output projection stays bf16), as torch._scaled_mm
with tensorwise scales on random data, both settings alternated product by product; then the
backward's difference per training step over --layers layers. A prediction, before any change to
the training code.

    python3 benchmarks/benchmark_float8_accumulation.py --dim 3072 --kv 1024 --ffn 8192 \
        --tokens 16384 --layers 28
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.benchmark_matmul_clocks import products  # noqa: E402
from benchmarks.benchmark_projections import kernel_ms  # noqa: E402


def float8_operands(m: int, n: int, k: int):
    """a (m x k) row-major and b (k x n) column-major in float8 e4m3, as _scaled_mm needs them."""
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    return a, b


def scaled_mm_ms(a, b, fast_accum: bool, repeat: int) -> float:
    """GPU milliseconds per product (tensorwise scales of 1, bf16 output)."""
    one = torch.ones((), device="cuda")
    return kernel_ms(
        lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast_accum),
        repeat,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--kv", type=int, default=1024, help="key (= value) projection width")
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch x sequence)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="times each setting is timed, alternating")
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()

    rows = []
    saved_ms = {"grad_input": 0.0, "grad_weight": 0.0}
    for name, m, n, k in products(args.dim, args.kv, args.ffn, vocab=0, tokens=args.tokens):
        if name.startswith("output."):
            continue  # kept in bf16 (float8.filter_fqns)
        a, b = float8_operands(m, n, k)
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for fast in (False, True):
                times[fast].append(scaled_mm_ms(a, b, fast, args.repeat))
        slow_ms, fast_ms = min(times[False]), min(times[True])
        flop = 2 * m * n * k
        row = {"product": name, "mnk": [m, n, k], "slow_ms": round(slow_ms, 4), "fast_ms": round(fast_ms, 4)}
        row |= {"slow_tflops": round(flop / slow_ms / 1e9), "fast_tflops": round(flop / fast_ms / 1e9)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        kind = name.split(".")[1]
        if kind in saved_ms:
            saved_ms[kind] += (slow_ms - fast_ms) * args.layers
        del a, b
    summary = {"layers": args.layers, "tokens": args.tokens}
    summary |= {f"{kind}_saved_ms_per_step": round(ms, 2) for kind, ms in saved_ms.items()}
    rows.append(summary)
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
