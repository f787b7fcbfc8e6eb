"""Optimizer state in bf16 against float32 (optimizer.state_dtype), AdamW and Muon, on the CPU:
the llama3 debug recipe (configs/llama3_debug.toml, the bundled corpus) for --steps steps, same
seed and data; reports the mean training loss of the last 50 steps and the final loss.

    python benchmarks/optimizer_state_dtype_cpu.py --out /tmp/state_dtype --steps 300
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = {  # name: optimizer overrides (lrs near the best of benchmarks/muon_vs_adamw_cpu.py's sweep)
    "AdamW-float32": ["--optimizer.lr", "1e-3"],
    "AdamW-bfloat16": ["--optimizer.lr", "1e-3", "--optimizer.state_dtype", "bfloat16"],
    "Muon-float32": ["--optimizer.name", "Muon", "--optimizer.lr", "1e-2"],
    "Muon-bfloat16": [
        "--optimizer.name",
        "Muon",
        "--optimizer.lr",
        "1e-2",
        "--optimizer.state_dtype",
        "bfloat16",
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    results = {}
    for name, overrides in RUNS.items():
        folder = args.out / name
        if not (folder / "metrics.jsonl").exists():
            recipe = str(REPO / "configs/llama3_debug.toml")
            subprocess.run([sys.executable, str(REPO / "train.py"), "--config", recipe,
                            "--training.device", "cpu", "--training.steps", str(args.steps),
                            "--training.local_batch_size", "8",  # one micro-batch of the recipe's 8
                            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
                            "--job.dump_folder", str(folder), *overrides], check=True, cwd=REPO)  # fmt: skip
        losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
        results[name] = {"last_50_mean": sum(losses[-50:]) / 50, "final": losses[-1]}
    lines = [f"| run ({args.steps} steps) | mean loss, last 50 steps | final loss |", "|---|---|---|"]
    lines += [f"| {n} | {r['last_50_mean']:.4f} | {r['final']:.4f} |" for n, r in results.items()]
    for optimizer in ("AdamW", "Muon"):
        full, half = results[f"{optimizer}-float32"], results[f"{optimizer}-bfloat16"]
        change = half["last_50_mean"] / full["last_50_mean"] - 1
        lines.append(f"\n{optimizer}: bf16 state {change:+.2%} on the last 50 steps' mean loss")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
