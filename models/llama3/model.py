"""Llama 3 (Meta's architecture: GQA, RoPE with Llama 3.1 scaling, RMSNorm, SwiGLU), in plain PyTorch.

No distributed code lives here: parallelize.py (beside this file) says how to shard it, and
parallelisms/ does the sharding. Build it on the meta device, parallelize, then materialize:

    with torch.device("meta"):
        model = Transformer(args)
    ... model.to_empty(device=...); model.init_buffers(); parameters from init_weights()

RoPE follows Meta's reference (rotation of interleaved pairs), so Hugging Face checkpoints need the
q/k permutation done in state_dict_adapter.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMask, CausalAttentionKernel


@dataclass
class Llama3Args:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    """0 = the tokenizer's vocabulary size, rounded up to a multiple of 64 (debug flavors)."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling_factor: float = 8.0
    """Llama 3.1 frequency scaling; 1.0 = none (Llama 3.0)."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_seq_len: int = 8192
    """Length of the RoPE table; train.py sets it to training.seq_len."""
    tie_embeddings: bool = False
    """Output projection shares the token-embedding matrix (Llama 3.2 1B and 3B)."""

    def __post_init__(self) -> None:
        """Shapes that cannot build a model (ValueError, reported as the run's error line)."""
        if min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.ffn_hidden_dim) < 1:
            raise ValueError("dim, n_layers, n_heads, n_kv_heads and ffn_hidden_dim must be >= 1")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"the head dimension dim / n_heads = {self.dim // self.n_heads} must be even (RoPE)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads}")


def rope_frequencies(args: Llama3Args) -> torch.Tensor:
    """Per-pair rotation frequencies, with the Llama 3.1 long-context scaling."""
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if args.rope_scaling_factor == 1.0:
        return freqs
    low_freq_wavelen = args.rope_original_max_position / args.rope_low_freq_factor
    high_freq_wavelen = args.rope_original_max_position / args.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (args.rope_original_max_position / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    blended = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / args.rope_scaling_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x (batch, seq, heads, head_dim) by position.

    cos/sin are (seq, head_dim/2); computed in float32 as Meta does. Written as
    x * (c, c) + (x[2i+1], x[2i]) * (-s, s), one element-wise expression over head_dim, rather
    than rotating each pair's even and odd elements and stacking them back: the same float32
    products and sums, but a compiled kernel 17% faster, and up to 1.9x when inductor tiles in
    two dimensions (benchmarks/benchmark_rope.py).
    """
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)  # (seq, 1, head_dim): over heads
    sin = torch.stack((-sin, sin), dim=-1).flatten(-2).unsqueeze(-2)
    x_float = x.float()
    swapped = x_float.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    return (x_float * cos + swapped * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.kernel = CausalAttentionKernel()
        self.n_heads = args.n_heads

    def qk_clip_scales(self, clip: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scales along dim 0 of the query and key weights that multiply head h's attention logits
        by clip[h] (MuonClip, training/qk_clip.py): a key head, which a group of query heads share,
        takes the square root of its group's smallest factor, each query head the rest."""
        group = self.n_heads * self.head_dim // self.wk.weight.shape[0]
        key = clip.view(-1, group).amin(dim=1).sqrt()
        query = clip / key.repeat_interleave(group)
        return {
            "wq.weight": query.repeat_interleave(self.head_dim),
            "wk.weight": key.repeat_interleave(self.head_dim),
        }

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = cos[:seq], sin[:seq]  # tables may be longer than this sequence
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init of the projections that write into the residual stream.
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)


class Transformer(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer index keeps names such as `layers.7` when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        head_dim = args.dim // args.n_heads
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, head_dim // 2), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab).

        positions: (seq,) rows of the RoPE tables to use (default: the first seq rows, each
        attention taking those it needs). attention_mask: None for causal attention, or the
        document mask of these sequences (models/attention.py), passed to every attention kernel.
        A pipeline stage that lacks the embedding, final norm or output (set to None) takes or
        returns hidden states instead.
        """
        if positions is None:
            cos, sin = self.rope_cos, self.rope_sin
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin, attention_mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_buffers(self, positions: torch.Tensor | None = None) -> None:
        """Fill the RoPE tables (deterministic; call after moving off the meta device).

        positions: the token positions this rank's sequences hold, in order (default all of
        0..max_seq_len-1); a context-parallel rank holds only some chunks of each sequence.
        """
        device = self.rope_cos.device
        if positions is None:
            positions = torch.arange(self.args.max_seq_len)
        angles = torch.outer(positions.to(device, torch.float32), rope_frequencies(self.args).to(device))
        self.rope_cos, self.rope_sin = angles.cos(), angles.sin()

    def init_weights(self) -> None:
        """Random init of every parameter, from torch's global RNG."""
        std = self.args.dim**-0.5
        if self.tok_embeddings is not None:
            if self.args.tie_embeddings:  # the same matrix also projects to logits: keep it small
                nn.init.trunc_normal_(self.tok_embeddings.weight, std=std, a=-3 * std, b=3 * std)
            else:
                nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_embeddings:
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token: 6 x matmul parameters + causal attention.

        Matmul parameters are all but the embedding table (the output projection counts, tied or
        not). Attention scores and values cost 2 x 2 x seq x dim per token and layer forward, halved
        for the causal mask, x 3 for forward + backward: 6 x n_layers x seq x dim.
        """
        params = sum(p.numel() for p in self.parameters())
        if not self.args.tie_embeddings:
            params -= self.tok_embeddings.weight.numel()
        attention = 6 * self.args.n_layers * seq_len * self.args.dim
        return 6 * params + attention
