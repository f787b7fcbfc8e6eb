"""The global gradient norm, whatever the parameters are sharded over, and clipping to it."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def group_by_mesh(tensors: list[torch.Tensor]) -> dict:
    """Tensors by the device mesh of their DTensor (None for plain tensors), in first-seen order."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(tensor)
    return groups or {None: []}


@torch.no_grad()
def global_grad_norm(
    parameters: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global L2 norm of the gradients (on the device, the same on every rank; nothing is read
    on the host).

    pp_group: with pipeline parallelism each stage holds some parameters; their norms are combined.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    # Gradients on different meshes (expert parallelism's experts and the rest) cannot share one
    # foreach call: one norm per mesh, then their combination.
    norms = []
    for same_mesh in group_by_mesh(grads).values():
        norm = _norm(same_mesh)
        # Sharded gradients give partial norms: reduce to the global one.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_group is not None:
        squared = total**2
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    return total


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of gradients on one mesh, summed in float32: bf16 gradients (those of the weight
    copies in training/bf16_weights.py, plain tensors) would get bf16 norms per tensor, ~0.2% off."""
    if grads and not isinstance(grads[0], DTensor) and any(g.dtype != torch.float32 for g in grads):
        by_dtype: dict = {}  # one foreach call per dtype: its fast path takes one dtype
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        per_tensor = [
            n for same in by_dtype.values() for n in torch._foreach_norm(same, 2.0, dtype=torch.float32)
        ]
        return torch.linalg.vector_norm(torch.stack(per_tensor))
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)


def clip_divisor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """What the gradients are divided by so that their norm is at most max_norm (>= 1, on the
    device); None when clipping is off (max_norm 0). Training/optimizer.py applies it: fused AdamW
    divides inside its kernel (its `grad_scale`, the gradient scaler's hook), the others through
    scale_grads_ first."""
    if max_norm <= 0:
        return None
    return torch.clamp((total_norm.float() + 1e-6) / max_norm, min=1.0)


@torch.no_grad()
def scale_grads_(parameters: list[torch.Tensor], divisor: torch.Tensor) -> None:
    """Divide every gradient by divisor. Each rank's local gradient data is scaled: right for every
    placement (sharded, replicated, or partial sums, which TP leaves on sequence-parallel norm
    weights). Scaling them through DTensor's foreach multiply went wrong with torch 2.11 on CUDA:
    TP 2 drifted from one GPU only when clipping scaled (docs/validation.md)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if local:
        torch._foreach_mul_(local, divisor.reciprocal().to(local[0].device))
