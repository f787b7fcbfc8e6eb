"""Run under torchrun: count FSDP's reduce-scatters in one step of 3 micro-batches, and its
divisions of the gradients by 1 (the loss is normalized already; torch's one-rank path divides by
any divide factor that is set, even 1.0: a pass over every gradient and a temporary as large).

Used by tests/test_parallel.py on 2 ranks, on 1 (FSDP over one device, as fault tolerance's
replica groups of one process run) and with expert parallelism over both ranks (the experts' FSDP
then spans one rank); arguments are config overrides. Builds the model and runs the step as
train.py does (training/model_setup.py, training/step.py).
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
divisions_by_1 = 0


def counting(collective):
    def wrapper(*args, **kwargs):
        global calls
        calls += 1
        return collective(*args, **kwargs)

    return wrapper


def counting_divisions_by_1(divide):
    def wrapper(tensor, divisor, *args, **kwargs):
        global divisions_by_1
        divisions_by_1 += isinstance(divisor, (int, float)) and divisor == 1
        return divide(tensor, divisor, *args, **kwargs)

    return wrapper


# FSDP2 reduce-scatters through one of these, depending on the torch version.
for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
    if hasattr(dist, name):
        setattr(dist, name, counting(getattr(dist, name)))
for name in ("__truediv__", "div", "div_"):
    setattr(torch.Tensor, name, counting_divisions_by_1(getattr(torch.Tensor, name)))

dist.init_process_group("gloo")
micro_batches = 3
local_batch = 12 // micro_batches // dist.get_world_size()  # global batch 12
config = load_config(["--model.flavor", "tiny", "--training.seq_len", "16", "--training.device", "cpu",
                      "--training.local_batch_size", str(local_batch), "--training.global_batch_size", "12",
                      "--parallelism.fsdp_single_device", "true", *sys.argv[1:]])  # fmt: skip
dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
mesh = dims.build_mesh("cpu")
model = build_model(config, dims, mesh, torch.device("cpu"))
no_replica_groups = FaultTolerance(config.fault_tolerance, torch.device("cpu"), dims.dp_replicate)
runner = StepRunner(model, dims, mesh, config, torch.device("cpu"), 12, micro_batches, no_replica_groups)
tokens = torch.randint(0, 258, (micro_batches, local_batch, 17))
runner.forward_backward([{"input": t[:, :-1], "labels": t[:, 1:]} for t in tokens])
(part,) = model.parts
assert all(p.grad is not None for p in part.parameters())
groups = len(part.layers) + 1
if dist.get_rank() == 0:
    print(f"reduce-scatters per step: {calls} ({groups} FSDP groups, {micro_batches} micro-batches)")
    print(f"gradient divisions by 1: {divisions_by_1}")
dist.barrier()
dist.destroy_process_group()
