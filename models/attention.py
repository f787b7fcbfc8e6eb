"""Attention kernels shared by the model families (plain PyTorch, no distributed code)."""

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttentionKernel(nn.Module):
    """softmax(QK^T/sqrt(d)) V with a causal mask, through SDPA.

    A module of its own so that parallelisms can swap it: context parallelism replaces every
    instance with its all-gather-KV version (parallelisms/context_parallel.py).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (batch, heads, seq, head_dim); k, v may have fewer heads (GQA).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
