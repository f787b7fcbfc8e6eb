"""Per-step relative difference of loss and grad norm between train.py on one process and on a
parallel layout, under chosen environment variables (each --env gives one pair of runs): the tool
behind docs/validation.md's account of the tensor-parallel drift on CUDA.

    python3 benchmarks/parity_probe.py --nproc 2 --layout "--parallelism.tensor_parallel_degree 2" \\
        --env "" --env NVIDIA_TF32_OVERRIDE=0 -- --model.flavor debugmodel --training.steps 20 \\
        --training.mixed_precision_param float32 --training.local_batch_size 8

Prints one JSON line per --env: the relative differences at every logged step.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(nproc: int, args: list[str], env: dict[str, str], folder: str) -> list[dict]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = [*torchrun, str(REPO / "train.py"), *args, "--metrics.log_freq", "1",
               "--metrics.enable_tensorboard", "false", "--job.dump_folder", folder]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{result.stderr[-3000:]}")
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, required=True, help="processes of the parallel layout")
    parser.add_argument("--layout", required=True, help="the layout's overrides, one string")
    parser.add_argument("--env", action="append", default=[], help='"NAME=VALUE ..." for both runs')
    argv = sys.argv[1:]
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    for variant in args.env or [""]:
        env = dict(os.environ, **dict(item.split("=", 1) for item in variant.split()))
        with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as many:
            reference = run(1, common, env, one)
            layout = run(args.nproc, [*common, *args.layout.split()], env, many)
        rel = lambda key, a, b: abs(a[key] - b[key]) / abs(b[key])
        steps = {
            a["step"]: {"loss": rel("loss", a, b), "grad_norm": rel("grad_norm", a, b)}
            for a, b in zip(layout, reference)
        }
        print(json.dumps({"env": variant, "layout": args.layout, "steps": steps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
