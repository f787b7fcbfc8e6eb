"""How tensor parallelism splits models/moe.py's layer, for any family that uses it.

The layer takes the whole sequence (gathered over TP, as a dense feed-forward's input is) and hands
back the rank's sequence shard. The router and the routed experts are not split: their parameters
become DTensors replicated over TP, and each rank computes on the same tokens with their local
tensors (models.grouped_experts.local_tensor), so outputs and gradients agree without any reduction.
The experts' work is therefore repeated on every TP rank; expert parallelism is what will shard it.
The shared experts are split like a dense feed-forward (columns in, rows out, all-reduced to the
replicated output).
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from models.moe import MoEArgs


class ReplicateParameters(ParallelStyle):
    """The module's own parameters become DTensors replicated over the mesh; its inputs and outputs
    stay local tensors (the module computes with its parameters' local tensors)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            # No broadcast: the weights are initialized afterwards, the same on every rank.
            replicated = distribute_tensor(param.data, device_mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        return module


def moe_plan(prefix: str, args: MoEArgs) -> dict[str, ParallelStyle]:
    """Styles for the MoE layer at `prefix` within a block (e.g. "moe"), whose input arrives as
    sequence shards (Shard(1)) and whose output leaves as sequence shards."""
    plan = {
        prefix: PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
        f"{prefix}.router": ReplicateParameters(),
        f"{prefix}.experts": ReplicateParameters(),
    }
    if args.shared_hidden_dim:
        plan |= {
            f"{prefix}.shared_experts.w1": ColwiseParallel(),
            f"{prefix}.shared_experts.w2": RowwiseParallel(),
            f"{prefix}.shared_experts.w3": ColwiseParallel(),
        }
    return plan
