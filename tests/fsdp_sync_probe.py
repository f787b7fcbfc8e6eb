"""Run under torchrun (2 ranks): count FSDP reduce-scatters in one step of 3 micro-batches.

Used by tests/test_parallel.py; builds the model exactly as train.py does.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import load_config
from models import get_model_spec
from models.spec import model_args
from parallelisms import ParallelDims, parallelize
from parallelisms.fsdp import set_gradient_sync
from training.weight_init import init_weights, materialize

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

config = load_config(["--model.flavor", "tiny", "--training.seq_len", "16", "--training.device", "cpu"])
dist.init_process_group("gloo")
dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
mesh = dims.build_mesh("cpu")
spec = get_model_spec("llama3")
args = model_args(spec, "tiny", 16, 258)
with torch.device("meta"):
    model, template = spec.model_cls(args), spec.model_cls(args)
parallelize(model, spec, dims, mesh, config, torch.device("cpu"))
materialize(model, torch.device("cpu"))
init_weights(model, template, 0)
model.init_buffers()
micro_batches = 3
for index in range(micro_batches):
    set_gradient_sync(model, index == micro_batches - 1)
    model(torch.randint(0, 258, (2, 16))).sum().backward()
    reduced = [p.grad is not None for p in model.parameters()]
    # Sharded gradients appear only once the last micro-batch has been reduced.
    assert all(reduced) if index == micro_batches - 1 else not any(reduced), (index, reduced)
groups = len(model.layers) + 1
if dist.get_rank() == 0:
    print(f"reduce-scatters per step: {calls} ({groups} FSDP groups, {micro_batches} micro-batches)")
dist.barrier()
dist.destroy_process_group()
