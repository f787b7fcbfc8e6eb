"""The global gradient norm, whatever the parameters are sharded over, and clipping to it."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(
    parameters: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The L2 norm of all gradients of the model, on every rank.

    pp_group: with pipeline parallelism each stage holds some parameters; their norms are combined.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # sharded gradients give partial norms: reduce to the global one
    if pp_group is not None:
        squared = total**2
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    return total


@torch.no_grad()
def clip_grads_(parameters: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so that their global norm is at most max_norm (inf: leave them)."""
    if max_norm != float("inf"):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
