"""torchtitan's own trainer on the step-speed shapes, for the comparison in docs/performance.md.

torchtitan v0.2.2 has no Llama 3 1B or 3B flavor and reads its data through Hugging Face
`datasets`. This script adds the two flavors (the shapes of configs/llama3_1b.toml and
configs/llama3_3b.toml: untied output, vocabulary 128,256, FFN 8,192), gpt-oss-20b cut to 4 or 2 blocks
and a stand-in for `datasets` that reads a JSONL file of {"text": ...} (the bundled sample by
default), then runs torchtitan's train.py `main` unchanged under torchrun. It prints one JSON line like
benchmarks/benchmark.py: tps is the mean of torchtitan's logged tok/s per GPU over the steps after
--warmup, memory its peak reserved.

    git clone -q --branch v0.2.2 --depth 1 https://github.com/pytorch/torchtitan /tmp/torchtitan
    python3 benchmarks/benchmark_torchtitan.py --torchtitan /tmp/torchtitan --flavor 3B --steps 20 \\
        --warmup 10 \\
        -- --training.local_batch_size 2 \\
        [--model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output]
    python3 benchmarks/benchmark_torchtitan.py --torchtitan /tmp/torchtitan --model gpt_oss \\
        --flavor 20b_4_layers --steps 20 --warmup 10

torchtitan needs tyro (and its docstring-parser and typeguard) beside what this repository needs.
Everything after `--` goes to torchtitan as its own overrides.
"""

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark import parser_with_common_options, run_and_report

REPO = Path(__file__).resolve().parent.parent

# The shapes of this repository's flavors, in torchtitan's terms: FFN 4 x dim x 2/3 x multiplier,
# rounded up to multiple_of (3B: 8,192 as is; 1B: 5,461 x 1.5 -> 8,192).
FLAVORS = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, rope_theta=500000),
    "3B": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, rope_theta=500000),
}
# gpt-oss shapes cut to fewer blocks (as `--model.args n_layers=4` does here): name -> (flavor, blocks)
GPT_OSS_CUTS = {"20b_4_layers": ("20b", 4), "20b_2_layers": ("20b", 2)}


def install_datasets_stand_in() -> None:
    """A module `datasets` with what torchtitan's text datasets use: load_dataset of a JSONL file,
    a map-style Dataset and datasets.distributed.split_dataset_by_node."""
    import types

    class Dataset:
        def __init__(self, rows: list[dict]):
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __iter__(self):
            return iter(self.rows)

        def skip(self, n: int) -> "Dataset":
            return Dataset(self.rows[n:])

    def load_dataset(path: str, *args, **kwargs) -> Dataset:
        with open(path) as f:
            return Dataset([json.loads(line) for line in f if line.strip()])

    def split_dataset_by_node(dataset: Dataset, rank: int, world_size: int) -> Dataset:
        return Dataset(dataset.rows[rank::world_size])

    module = types.ModuleType("datasets")
    module.Dataset, module.IterableDataset, module.load_dataset = Dataset, Dataset, load_dataset
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = split_dataset_by_node
    module.distributed = distributed
    sys.modules["datasets"], sys.modules["datasets.distributed"] = module, distributed


def child() -> None:
    """Inside torchrun: torchtitan's main with the flavors and the stand-in installed."""
    # drop --child before torchtitan is imported: its parser's default arguments are read at import
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    install_datasets_stand_in()
    from torchtitan.models import gpt_oss, llama3
    from torchtitan.train import Trainer, main

    for name, shape in FLAVORS.items():
        llama3.llama3_args[name] = llama3.TransformerModelArgs(**shape)
    for name, (flavor, n_layers) in GPT_OSS_CUTS.items():
        gpt_oss.gptoss_configs[name] = dataclasses.replace(gpt_oss.gptoss_configs[flavor], n_layers=n_layers)
    main(Trainer)


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    torchtitan = Path(args.torchtitan).resolve()
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            __file__, "--child",
            "--model.name", args.model, "--model.flavor", args.flavor,
            "--model.hf_assets_path", str(torchtitan / "tests/assets/tokenizer"),
            "--training.dataset", "c4_test", "--training.dataset_path", args.data,
            "--training.seq_len", str(args.seq_len), "--training.local_batch_size", "1",
            "--training.steps", str(args.steps),
            "--training.max_norm", "1.0", "--lr_scheduler.warmup_steps", "100",
            "--activation_checkpoint.mode", "none", *(["--compile.enable"] if args.compile else []),
            "--metrics.log_freq", str(args.log_freq), "--job.dump_folder", folder, *overrides,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{torchtitan}:{os.environ.get('PYTHONPATH', '')}"}
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder)
        wall = time.perf_counter() - start
    log = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    # torchtitan's log line: "step: 15  loss: 7.1  grad_norm: 1.2  memory: 75.31GiB(52.41%)  tps: 20,472 ..."
    line = (
        r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[\d.]+)"
        r".*?memory:\s*(?P<mem>[\d.]+)GiB.*?tps:\s*(?P<tps>[\d,]+)"
    )
    steps = {int(m["step"]): m for m in re.finditer(line, log)}
    if result.returncode != 0 or not steps:
        return {"name": args.name, "error": log[-3000:], "returncode": result.returncode}
    measured = [m for step, m in steps.items() if args.warmup < step <= args.steps] or [steps[max(steps)]]
    return {
        "name": args.name,
        "torchtitan": str(torchtitan),
        "flavor": args.flavor,
        "nproc": args.nproc,
        "overrides": " ".join(overrides),
        "steps": args.steps,
        "tps": round(statistics.mean(int(m["tps"].replace(",", "")) for m in measured)),
        "memory_gib": max(float(m["mem"]) for m in steps.values()),
        "final_loss": float(steps[max(steps)]["loss"]),
        "wall_s": round(wall, 1),
    }


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child()
        return 0
    parser = parser_with_common_options(__doc__, steps=20)
    parser.add_argument("--torchtitan", required=True, help="a checkout of torchtitan (v0.2.2)")
    parser.add_argument("--model", default="llama3", choices=["llama3", "gpt_oss"])
    flavors = ", ".join([*FLAVORS, *GPT_OSS_CUTS])
    parser.add_argument("--flavor", required=True, help=f"{flavors} or one of torchtitan's")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    sample = str(REPO / "data/sample/python_docs.jsonl")
    parser.add_argument("--data", default=sample, help='JSONL of {"text": ...}')
    return run_and_report(parser, run)


if __name__ == "__main__":
    sys.exit(main())
