"""Muon's cost on one GPU: the 1B step with AdamW and with Muon, at one sequence per update and with
gradient accumulation, and the time of Newton-Schulz per matrix shape of the 1B model.

    python benchmarks/muon_speed_gpu.py --out /tmp/muon_gpu [--steps 20] [--accumulation 8]

Writes <out>/steps.jsonl (benchmark.py's line per run) and <out>/newton_schulz.json (per shape: the
matrices of that shape in the model, milliseconds per orthogonalization of the stack, TFLOP/s).
Newton-Schulz FLOPs per matrix (rows <= cols after transposing): steps x (2 r^2 c + 2 r^3 + 2 r^2 c).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def newton_schulz_times(out: Path) -> None:
    import torch

    from training.muon import newton_schulz

    dim, kv, ffn, layers = 2048, 512, 8192, 16  # the 1B flavor: models/llama3 flavors
    shapes = {(dim, dim): 2 * layers, (kv, dim): 2 * layers, (ffn, dim): 2 * layers, (dim, ffn): layers}
    coefficients = (3.4445, -4.7750, 2.0315)
    results = []
    for (rows, cols), count in shapes.items():
        stack = torch.randn(count, rows, cols, device="cuda", dtype=torch.float32)
        for _ in range(3):
            newton_schulz(stack, 5, coefficients, torch.bfloat16)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            newton_schulz(stack, 5, coefficients, torch.bfloat16)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        r, c = min(rows, cols), max(rows, cols)
        flops = count * 5 * (4 * r * r * c + 2 * r**3)
        results.append({"shape": [rows, cols], "matrices": count, "ms": ms, "tflops": flops / ms / 1e9})
    total = sum(r["ms"] for r in results)
    (out / "newton_schulz.json").write_text(json.dumps({"per_shape": results, "total_ms": total}, indent=1))
    print(json.dumps({"per_shape": results, "total_ms": total}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulation", type=int, default=8, help="0: leave that run out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    newton_schulz_times(args.out)
    muon = ["--optimizer.name", "Muon", "--optimizer.lr", "5e-3"]
    runs = [("adamw_batch1", args.steps, []), ("muon_batch1", args.steps, muon)]
    if args.accumulation:
        runs.append(
            (
                f"muon_accum{args.accumulation}",
                8,
                [*muon, "--training.global_batch_size", str(args.accumulation)],
            )
        )
    for name, steps, overrides in runs:
        command = [
            sys.executable, str(REPO / "benchmarks/benchmark.py"), "--config", "configs/llama3_1b.toml",
            "--name", name, "--steps", str(steps), "--warmup", str(steps // 2), "--log-freq", "1",
            "--out", str(args.out / "steps.jsonl"), "--", *overrides,
        ]  # fmt: skip
        subprocess.run(command, check=False)


if __name__ == "__main__":
    main()
