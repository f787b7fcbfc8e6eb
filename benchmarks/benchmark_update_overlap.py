"""How much of the optimizer update a concurrent forward hides on one GPU (a prediction, before
building anything): the model's forward alone, fused AdamW alone, and both at once on two streams.

    python benchmarks/benchmark_update_overlap.py --config configs/llama3_1b.toml
    python benchmarks/benchmark_update_overlap.py --config configs/llama3_3b.toml --repeat 5

The update of step k could run while step k+1's forward starts, block i's forward waiting only for
block i's parameters. What that saves is bounded by `forward + update - both` (the update time the
forward hides when nothing orders them); printed as one JSON line. Numbers are garbage-in: the
update writes weights the forward reads, which costs the same time.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import load_config  # noqa: E402
from parallelisms import ParallelDims  # noqa: E402
from training import distributed  # noqa: E402
from training.model_setup import build_model  # noqa: E402


def gpu_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--repeat", type=int, default=7)
    args, overrides = parser.parse_known_args()
    config = load_config(["--config", args.config, "--parallelism.fsdp_single_device", "false", *overrides])
    device = distributed.select_device("cuda")
    dims = ParallelDims.from_config(config.parallelism, 1)
    distributed.init_process_group(device)
    model = build_model(config, dims, dims.build_mesh("cuda"), device)
    net = model.parts[0]
    params = list(net.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    batch = config.training.local_batch_size
    tokens = torch.randint(0, model.args.vocab_size, (batch, config.training.seq_len), device=device)

    def forward() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            net(tokens)  # activations kept for backward, as in training, then dropped

    side = torch.cuda.Stream()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            optimizer.step()
        forward()
        torch.cuda.current_stream().wait_stream(side)

    for _ in range(2):  # compile
        forward()
    update_ms = gpu_ms(optimizer.step, args.repeat)
    forward_ms = gpu_ms(forward, args.repeat)
    both_ms = gpu_ms(both, args.repeat)
    print(json.dumps({
        "config": args.config, "batch": batch, "forward_ms": round(forward_ms, 2),
        "update_ms": round(update_ms, 2), "both_ms": round(both_ms, 2),
        "hidden_ms": round(forward_ms + update_ms - both_ms, 2),
        "hidden_fraction": round((forward_ms + update_ms - both_ms) / update_ms, 3),
    }))  # fmt: skip
    distributed.destroy_process_group()


if __name__ == "__main__":
    main()
