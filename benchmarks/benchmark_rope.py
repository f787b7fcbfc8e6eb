"""Time RoPE alone, compiled, forward + backward, in several formulations and inductor tiling
settings: which formulation stays fast when inductor tiles in two dimensions (the setting that
makes the float8 step's transposed casts coalesced, docs/performance.md)?

Formulations (all float32 arithmetic on bf16 input, equal results):
  stack    the even and odd elements of each pair rotated, then stacked back (the model's before
           2026-12-03)
  swap     the model's `apply_rope`: x * (c, c) + (x[2i+1], x[2i]) * (-s, s), the tables
           repeated per pair in the graph
  tables   as swap, the (seq, head_dim) tables made before the compiled call
With --layout halves (Qwen 3: the first half of head_dim rotated against the second):
  cat      Qwen 3's `rotate_halves`: each half rotated, then concatenated back
  roll     x * (c, c) + roll(x, head_dim / 2) * (-s, s), one expression over head_dim

    python3 benchmarks/benchmark_rope.py --batch 2 --seq 8192 --heads 24 --kv-heads 8 --head-dim 128
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.benchmark_projections import kernel_ms  # noqa: E402
from models.llama3.model import apply_rope  # noqa: E402
from models.qwen3.model import rotate_halves  # noqa: E402


def rope_stack(x, cos, sin):
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


def rope_tables(x, cos2, sin2):
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos2.unsqueeze(-2) + swapped * sin2.unsqueeze(-2)).type_as(x)


def halves_roll(x, cos, sin):
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2)
    sin = torch.cat((-sin, sin), dim=-1).unsqueeze(-2)
    x_float = x.float()
    return (x_float * cos + x_float.roll(x.shape[-1] // 2, dims=-1) * sin).type_as(x)


SETTINGS = {
    "default": {},
    "nd_tiling": {"prefer_nd_tiling": True, "tile_reductions": True},
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layout", choices=("pairs", "halves"), default="pairs")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()

    angles = torch.rand(args.seq, args.head_dim // 2, device="cuda") * 100
    cos, sin = angles.cos(), angles.sin()
    cos2 = cos.repeat_interleave(2, -1)
    sin2 = torch.stack((-sin, sin), dim=-1).flatten(-2)
    rows = []
    for heads in (args.heads, args.kv_heads):
        shape = (args.batch, args.seq, heads, args.head_dim)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        if args.layout == "pairs":
            reference = apply_rope(x, cos, sin)
            formulations = [
                ("stack", rope_stack, (cos, sin)),
                ("swap", apply_rope, (cos, sin)),
                ("tables", rope_tables, (cos2, sin2)),
            ]
        else:
            reference = rotate_halves(x, cos, sin)
            formulations = [("cat", rotate_halves, (cos, sin)), ("roll", halves_roll, (cos, sin))]
        for setting, options in SETTINGS.items():
            for name, fn, tables in formulations:
                torch._dynamo.reset()
                with inductor_config.patch({f"triton.{k}": v for k, v in options.items()}):
                    compiled = torch.compile(fn)
                    out = compiled(x, *tables)
                    error = (out.float() - reference.float()).abs().max().item()

                    def step(c=compiled, t=tables, x=x, g=grad):
                        c(x, *t).backward(g)

                    ms = kernel_ms(step, args.repeat)
                gbytes = 4 * x.numel() * 2 / 1e9  # x and out forward, grad in and out backward
                row = {"heads": heads, "setting": setting, "rope": name, "ms": round(ms, 4)}
                row["layout"] = args.layout
                row |= {"tb_per_s": round(gbytes / ms, 2), "max_abs_diff_vs_eager": error}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
