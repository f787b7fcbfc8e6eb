"""Estimate the per-rank memory of a config on a target layout, without GPUs.

    python scripts/estimate_memory.py --world-size 64 -- --config configs/llama3_70b.toml \\
        --parallelism.tensor_parallel_degree 8 --training.local_batch_size 2

Everything after `--` is train.py's command line. Builds the model on the meta device for rank 0
of the target world (fake process group), applies the parallelisms, and prints one JSON line:
weights, gradients and optimizer states from the rank's actual shards, FSDP's gathered copies, and
activations from the coefficient in training/memory_estimate.py (calibrated on an H200 with
compiled bf16 Llama 3; docs/performance.md compares estimates with measured peaks).
"""

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import UserError, load_config
from training.dry_run import dry_run


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the target launch")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    logging.basicConfig(level=logging.WARNING)
    try:
        config = load_config([*argv[split + 1 :], "--job.dry_run_world_size", str(args.world_size)])
        estimate = dry_run(config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {key: round(value, 2) if isinstance(value, float) else value
              for key, value in dataclasses.asdict(estimate).items()}  # fmt: skip
    print(json.dumps({**result, "total_gib": round(estimate.total_gib, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
