"""Seeded weight init that gives the same weights whatever the parallel layout.

Each parameter is drawn in full (unsharded) from its own seed, derived from job.seed and the
parameter's name, by the model's own init_weights() run on a meta-device copy of the model in which
only that parameter is real; the rank then keeps its shard. The values therefore depend on neither
the order of parameters nor which of them a rank holds (FSDP, TP, PP all give the same model).
Memory: one full parameter at a time. Random streams differ between CPU and CUDA. Leaves the
global RNG seeded with job.seed.
"""

import inspect
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from parallelisms.tied_weights import retie, tied_parameter_names
from parallelisms.wrapper_names import original_name


def parameter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _initializer_of(template: nn.Module, owner: str) -> nn.Module:
    """The nearest module at or above `owner` whose init_weights() takes no arguments."""
    parts = owner.split(".") if owner else []
    for depth in range(len(parts), -1, -1):
        module = template.get_submodule(".".join(parts[:depth]))
        init = getattr(module, "init_weights", None)
        if init is not None and all(
            p.default is not inspect.Parameter.empty for p in inspect.signature(init).parameters.values()
        ):
            return module
    raise ValueError(f"no init_weights() above '{owner}' in {type(template).__name__}")


def materialize(model: nn.Module, device: torch.device) -> None:
    """model.to_empty(device), keeping tied parameters tied (to_empty would untie them)."""
    groups = tied_parameter_names(model)
    model.to_empty(device=device)
    retie(model, groups)


@torch.no_grad()
def init_weights(model: nn.Module, template: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` (materialized, maybe sharded) with seeded values.

    `template` is the same architecture, unsharded, on the meta device.
    """
    for fqn, param in model.named_parameters():
        name = original_name(fqn)
        owner, _, leaf = name.rpartition(".")
        holder = template.get_submodule(owner)
        meta_param = holder._parameters[leaf]
        full = torch.empty(meta_param.shape, dtype=param.dtype, device=param.device)
        holder._parameters[leaf] = nn.Parameter(full, requires_grad=False)
        torch.manual_seed(parameter_seed(seed, name))
        _initializer_of(template, owner).init_weights()
        holder._parameters[leaf] = meta_param
        copy_full_tensor(param, full)
    torch.manual_seed(seed)  # leave the global RNG in a defined state


def copy_full_tensor(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of the full (unsharded) tensor into param, sharded or not."""
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)
