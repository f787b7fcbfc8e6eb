"""FSDP2 (fully_shard) per transformer block and the root, with mixed precision; HSDP on a 2-D mesh."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from models.moe import moe_layers


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard every block of model.layers, then the root (embedding, final norm, output) together.

    expert_mesh: under expert parallelism, the routed experts of MoE layers are sharded apart, over
    the ranks expert parallelism leaves (their weights already live on other meshes than the block's).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def shard(module: nn.Module, mesh: DeviceMesh, reshard: bool) -> None:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        # The loss is already normalized by the global token count: gradients are summed, not
        # averaged (divide factor 1, and plain SUM collectives, which every backend has). A mesh of
        # one rank has nothing to sum, and torch's one-rank path would still divide every gradient
        # by the factor, even 1.0 (the whole model under fsdp_single_device or a fault-tolerance
        # replica group of one process; the experts when expert parallelism spans the FSDP ranks).
        if mesh.size() > 1:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: keep them by default.
        reshard = {"always": True, "never": False, "default": index < len(blocks) - 1}[reshard_after_forward]
        if expert_mesh is not None:
            for moe in moe_layers(block).values():
                shard(moe.experts, expert_mesh, reshard)
        shard(block, mesh, reshard)
    shard(model, mesh, reshard_after_forward == "always")


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """With gradient accumulation, reduce gradients only on the last micro-batch of a step."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
