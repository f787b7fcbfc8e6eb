"""Context parallelism: the sequence of every sample is split over the cp ranks.

Load balance for causal attention: the sequence is cut into 2 x cp chunks and rank r holds chunks
r and 2 x cp - 1 - r, so every rank has the same amount of attention work (an early chunk attends
to few keys, its partner late chunk to many). Inputs, labels and RoPE positions follow the split;
the loss is summed over the cp ranks like over data-parallel ranks.

Attention: each rank all-gathers K and V (small under GQA) from the cp group, rebuilds them in
sequence order and computes exact causal attention for its two query chunks, each against the
keys up to its own end (a lower-right causal mask, which SDPA runs with its flash or
memory-efficient kernels on CUDA and with an explicit mask on CPU). In backward, the K/V gradients
are reduce-scattered back to their owners. Works on gloo (CPU) and NCCL (CUDA) alike.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from configs import UserError
from models.attention import AttentionMask, CausalAttentionKernel, masked_attention


def local_positions(seq_len: int, cp_rank: int, cp_degree: int) -> torch.Tensor:
    """Positions (within a sequence) of the tokens that this cp rank holds, in its local order."""
    chunk = seq_len // (2 * cp_degree)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_degree - 1 - cp_rank) * chunk, (2 * cp_degree - cp_rank) * chunk)
    return torch.cat([first, second])


def shard_sequences(batch: dict, positions: torch.Tensor) -> dict:
    """This rank's part of a batch's inputs and labels (dimension 1 is the sequence)."""
    return {**batch, "input": batch["input"][:, positions], "labels": batch["labels"][:, positions]}


class _GatherChunks(torch.autograd.Function):
    """All-gather along a new leading dimension; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # ranks concatenated along dim 0
        dist.all_gather_into_tensor(out, x, group=group)
        return out.unflatten(0, (size, -1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(
            out, grad.flatten(0, 1).contiguous(), op=dist.ReduceOp.SUM, group=ctx.group
        )
        return out, None


class ContextParallelAttention(nn.Module):
    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.group = cp_mesh.get_group()
        self.rank = cp_mesh.get_local_rank()
        self.degree = cp_mesh.size()

    def _full_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, 2 x chunk, dim) local -> (batch, heads, seq, dim) in sequence order."""
        gathered = _GatherChunks.apply(x, self.group)  # (cp, batch, heads, 2 x chunk, dim)
        halves = gathered.unflatten(3, (2, -1))  # rank j: chunks j and 2cp-1-j
        ordered = [halves[c, :, :, 0] for c in range(self.degree)]
        ordered += [halves[2 * self.degree - 1 - c, :, :, 1] for c in range(self.degree, 2 * self.degree)]
        return torch.cat(ordered, dim=2)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        keys, values = self._full_sequence(k), self._full_sequence(v)
        if mask is not None:  # a document mask, built for this rank's query positions
            return masked_attention(q, keys, values, mask)
        return attend_local_chunks(q, keys, values, self.rank, self.degree)


def attend_local_chunks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rank: int, degree: int
) -> torch.Tensor:
    """Exact causal attention of a cp rank's two query chunks (q: batch, heads, 2 x chunk, dim)
    against the keys and values of the whole sequence, in sequence order."""
    chunk = q.shape[2] // 2
    outputs = []
    for half, index in enumerate((rank, 2 * degree - 1 - rank)):
        query = q[:, :, half * chunk : (half + 1) * chunk]
        end = (index + 1) * chunk  # this chunk sees every key up to its own last token
        mask = causal_lower_right(chunk, end)
        outputs.append(
            F.scaled_dot_product_attention(
                query, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True
            )
        )
    return torch.cat(outputs, dim=2)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Swap every causal attention kernel of the model for the context-parallel one."""
    kernels = [name for name, module in model.named_modules() if isinstance(module, CausalAttentionKernel)]
    has_layers = any(True for _ in getattr(model, "layers", {}))  # a pipeline stage may hold none
    if not kernels and has_layers:
        raise UserError(
            "context parallelism needs the model's attention to call "
            f"models.attention.CausalAttentionKernel; {type(model).__name__} has none"
        )
    for name in kernels:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, ContextParallelAttention(cp_mesh))
