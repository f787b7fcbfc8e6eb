"""Benchmark a config: run N steps of train.py and print one JSON line of throughput and memory.

    python benchmarks/benchmark.py --config configs/llama3_1b.toml --steps 30 -- --compile.enable
    python benchmarks/benchmark.py --config configs/llama3_3b.toml --nproc 8 --out results.jsonl -- \\
        --training.local_batch_size 2

Everything after `--` is passed to train.py as overrides; a step is one micro-batch per rank (the
recipe's global batch replaced by -1) unless they set --training.global_batch_size. The numbers are
train.py's own metrics (per device): tps and TFLOP/s are the mean over the steps after --warmup,
memory is the peak reserved by the CUDA allocator, and time_to_first_step_s runs from launch to the
end of step 1 (start-up, initialization and, with compile, compilation).
"""

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    steps = args.steps
    if args.profile_dir:  # trace two extra steps after the measured ones (the profiler slows them)
        steps = args.steps + 3
        overrides = [*overrides, "--profiling.enable", "--profiling.start_step", str(args.steps + 2)]
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            str(REPO / "train.py"), "--config", args.config, "--training.steps", str(steps),
            "--metrics.log_freq", str(args.log_freq), "--metrics.enable_tensorboard", "false",
            # One micro-batch per rank and step, whatever global batch the recipe trains with.
            "--training.global_batch_size", "-1", "--job.dump_folder", folder, *overrides,
        ]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        log = result.stdout + result.stderr
        if result.returncode != 0:
            return {"name": args.name, "error": log[-3000:], "returncode": result.returncode}
        metrics = Path(folder) / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        if args.keep_metrics:
            shutil.copy(metrics, args.keep_metrics)
        if args.profile_dir:
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
            for trace in (Path(folder) / "profiles").glob("*"):
                shutil.copy(trace, Path(args.profile_dir) / f"{args.name or 'run'}_{trace.name}")
    measured = [r for r in records if args.warmup < r["step"] <= args.steps] or records[-1:]
    first_step = re.search(r"step 1 done ([\d.]+) s after start", log)
    mfu = [r["mfu"] for r in measured if r["mfu"] is not None]
    return {
        "name": args.name,
        "config": args.config,
        "nproc": args.nproc,
        "overrides": " ".join(overrides),
        "steps": args.steps,
        "tps": round(statistics.mean(r["tps"] for r in measured)),
        "tflops": round(statistics.mean(r["tflops"] for r in measured), 1),
        "mfu": round(statistics.mean(mfu), 2) if mfu else None,
        "memory_gib": max(r["memory_gib"] for r in records),
        "time_to_first_step_s": float(first_step.group(1)) if first_step else None,
        "final_loss": records[-1]["loss"],
        # (float8 vs bf16 over a long run: the mean of the logged losses of the last 50 steps)
        "mean_loss_last_50_steps": statistics.mean(
            r["loss"] for r in records if r["step"] > records[-1]["step"] - 50
        ),
        "wall_s": round(wall, 1),
    }


def parser_with_common_options(description: str, steps: int) -> argparse.ArgumentParser:
    """The options every benchmark of a trainer takes (this one and benchmark_torchtitan.py)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", default="", help="label for the result")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput")
    parser.add_argument("--log-freq", type=int, default=5)
    parser.add_argument("--out", help="also append the JSON line to this file")
    return parser


def run_and_report(parser: argparse.ArgumentParser, run) -> int:
    """Parse the command line (the trainer's overrides after `--`), run, print the JSON line and
    append it to --out."""
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    result = run(args, overrides)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0 if "error" not in result else 1


def main() -> int:
    parser = parser_with_common_options(__doc__, steps=30)
    parser.add_argument("--config", required=True)
    parser.add_argument("--keep-metrics", help="also copy the run's metrics.jsonl (every logged step) here")
    parser.add_argument("--profile-dir", help="also trace two steps after warm-up and keep the traces here")
    return run_and_report(parser, run)


if __name__ == "__main__":
    sys.exit(main())
