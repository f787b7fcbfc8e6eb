"""Expert parallelism: the routed experts of every MoE layer (models/moe.py) are spread over the "ep"
ranks, each holding n_experts / ep of them, and tokens travel to their experts' ranks and back.

The MoE layer is unchanged: it routes its tokens, sorts their top-k copies by expert and hands them
to `moe.experts(copies, tokens_per_expert)`, expecting the outputs in the same order. Under EP two
hooks around that call do the travelling:

  before  1. exchange the per-expert counts (all-to-all) and read the split sizes on the host:
             one host-device synchronization per MoE layer and forward
          2. send every rank the copies for its experts (all-to-all with uneven splits)
          3. reorder what arrived (grouped by source rank) by local expert
  experts    run on the rank's own experts (their weights' local shard)
  after   4. undo the reorder and send the outputs back (all-to-all)

Autograd runs the all-to-alls backwards with the same splits. The expert weights become DTensors
sharded on dim 0 over "ep" (replicated over "tp" under tensor parallelism), so checkpoints hold the
whole stacked tensors under their usual names and reshard to any EP degree.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from configs import UserError
from models.moe import moe_layers


def check_expert_parallel(model: nn.Module) -> None:
    """The whole model (before pipeline splitting: a stage may hold dense blocks only) has experts."""
    if not moe_layers(model):
        raise UserError(
            "parallelism.expert_parallel_degree needs a model with Mixture-of-Experts layers "
            f"(models.moe.MoE); {type(model).__name__} has none"
        )


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, ep_mesh: DeviceMesh) -> None:
    """Shard the experts of every MoE layer over ep_mesh (expert_mesh: ep, or ep x tp) and route
    their tokens through it."""
    for moe in moe_layers(model).values():
        if moe.args.n_experts % ep_mesh.size():
            raise UserError(
                f"expert_parallel_degree {ep_mesh.size()} does not divide the {moe.args.n_experts} experts"
            )
        _shard_expert_weights(moe.experts, expert_mesh)
        ExpertDispatch(ep_mesh.get_group(), moe.args.n_experts).attach(moe.experts)


def _shard_expert_weights(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Stacked (experts, in, out) weights become Shard(0) over ep (and Replicate over tp)."""
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    for name, param in list(experts.named_parameters(recurse=False)):
        full = param.to_local() if isinstance(param, DTensor) else param  # replicated over TP before
        # No broadcast: weights are initialized afterwards, each rank filling its own shard.
        sharded = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class ExpertDispatch:
    """The all-to-all exchange around one MoE layer's experts (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int):
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.local_experts = n_experts // self.ranks
        self.in_flight: tuple | None = None  # from the pre-hook to the hook of the same call

    def attach(self, experts: nn.Module) -> None:
        experts.register_forward_pre_hook(self.send_to_experts)
        experts.register_forward_hook(self.send_back)

    def send_to_experts(self, module: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        copies, tokens_per_expert = inputs
        # 1. Counts: how many copies this rank sends each expert, and receives for its own.
        send_counts = tokens_per_expert.to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        received = recv_counts.view(self.ranks, self.local_experts)  # [source rank, local expert]
        sizes = torch.stack([send_counts.view(self.ranks, -1).sum(1), received.sum(1)])
        send_sizes, recv_sizes = sizes.tolist()  # the host needs the split sizes
        # 2. The copies for each rank's experts go to that rank.
        arrived = funcol.all_to_all_single_autograd(copies, recv_sizes, send_sizes, self.group)
        # 3. Arrived grouped by source rank, then expert: regroup by expert, then source rank.
        order = _by_expert(received, sum(recv_sizes))
        self.in_flight = (order, send_sizes, recv_sizes)
        return arrived[order], received.sum(0)

    def send_back(self, module: nn.Module, inputs: tuple, outputs: torch.Tensor) -> torch.Tensor:
        order, send_sizes, recv_sizes = self.in_flight
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        # 4. Back in arrival order, and to the ranks they came from.
        return funcol.all_to_all_single_autograd(outputs[inverse], send_sizes, recv_sizes, self.group)


def _by_expert(received: torch.Tensor, total: int) -> torch.Tensor:
    """The gather order that turns copies arrived as [source rank][local expert] runs into
    [local expert][source rank] runs; received[r, e] is the length of run (r, e)."""
    lengths = received.flatten()
    starts = (lengths.cumsum(0) - lengths).view(received.shape).t().flatten()  # in arrival order
    lengths = received.t().flatten()  # in the new order
    new_starts = lengths.cumsum(0) - lengths
    shift = torch.repeat_interleave(starts - new_starts, lengths, output_size=total)
    return shift + torch.arange(total, device=received.device)
