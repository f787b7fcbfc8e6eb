"""Run under torchrun: one Muon step of the tiny model (llama3, or as the config overrides given
as arguments say), counting the matrices each rank orthogonalizes. Each rank prints its count;
rank 0 prints the model's Muon matrices, each 2-D matrix and each expert counting one.

Used by tests/test_muon.py: the counts add up to the matrices (each is orthogonalized once, on one
rank, replicas included) and divide evenly (no rank holds more than its share of a stack, rounded
up). Builds the model as train.py does (training/model_setup.py)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import load_config
from parallelisms import ParallelDims
from training import muon
from training.model_setup import build_model
from training.optimizer import Optimizers, parameter_roles

orthogonalized = []  # matrices per Newton-Schulz call on this rank
newton_schulz = muon.newton_schulz


def counting(update, **settings):
    orthogonalized.append(update[..., 0, 0].numel())
    return newton_schulz(update, **settings)


muon.newton_schulz = counting
dist.init_process_group("gloo")
config = load_config(["--model.flavor", "tiny", "--training.device", "cpu", "--optimizer.name", "Muon",
                      *sys.argv[1:]])  # fmt: skip
dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
mesh = dims.build_mesh("cpu")
model = build_model(config, dims, mesh, torch.device("cpu"))
optimizers = Optimizers(model.parts, config.optimizer, config.lr_scheduler, 10, torch.device("cpu"))
for part in model.parts:
    for p in part.parameters():
        p.grad = torch.ones_like(p)
optimizers.step()
rank = dist.get_rank()
print(f"rank {rank} orthogonalized {sum(orthogonalized)} in {len(orthogonalized)} calls", flush=True)
if rank == 0:
    roles = parameter_roles(model.parts[0], config.optimizer)
    shapes = {n: p.shape for n, p in model.parts[0].named_parameters()}
    total = sum(shapes[n][0] if len(shapes[n]) == 3 else 1 for n, r in roles.items() if r == "muon")
    print(f"muon matrices {total}")
dist.barrier()
dist.destroy_process_group()
