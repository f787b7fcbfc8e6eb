"""Run under torchrun (2 ranks): count FSDP reduce-scatters in one step of 3 micro-batches.

Used by tests/test_parallel.py; builds the model and runs the step as train.py does
(training/model_setup.py, training/step.py).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import load_config
from parallelisms import ParallelDims
from training.fault_tolerance import FaultTolerance
from training.model_setup import build_model
from training.step import StepRunner

calls = 0


def counting(collective):
    def wrapper(*args, **kwargs):
        global calls
        calls += 1
        return collective(*args, **kwargs)

    return wrapper


# FSDP2 reduce-scatters through one of these, depending on the torch version.
for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
    if hasattr(dist, name):
        setattr(dist, name, counting(getattr(dist, name)))

micro_batches = 3
config = load_config(["--model.flavor", "tiny", "--training.seq_len", "16", "--training.device", "cpu",
                      "--training.local_batch_size", "2", "--training.global_batch_size", "12"])  # fmt: skip
dist.init_process_group("gloo")
dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
mesh = dims.build_mesh("cpu")
model = build_model(config, dims, mesh, torch.device("cpu"))
no_replica_groups = FaultTolerance(config.fault_tolerance, torch.device("cpu"), dims.dp_replicate)
runner = StepRunner(model, dims, mesh, config, torch.device("cpu"), 12, micro_batches, no_replica_groups)
tokens = torch.randint(0, 258, (micro_batches, 2, 17))
runner.forward_backward([{"input": t[:, :-1], "labels": t[:, 1:]} for t in tokens])
(part,) = model.parts
assert all(p.grad is not None for p in part.parameters())
groups = len(part.layers) + 1
if dist.get_rank() == 0:
    print(f"reduce-scatters per step: {calls} ({groups} FSDP groups, {micro_batches} micro-batches)")
dist.barrier()
dist.destroy_process_group()
