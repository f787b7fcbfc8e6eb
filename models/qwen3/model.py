"""Qwen3 dense (GQA with QK-norm, explicit head_dim, RoPE, RMSNorm, SwiGLU), in plain PyTorch.

Self-contained on purpose (a fork copies this folder and owns every line); the only shared piece
is models/attention.py's kernel, which context parallelism swaps. RoPE rotates the two halves of
each head, as in Hugging Face's Qwen3, so its checkpoints load without permutation.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMask, CausalAttentionKernel


@dataclass
class Qwen3Args:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden_dim: int
    vocab_size: int
    """0 = the tokenizer's vocabulary size, rounded up to a multiple of 64 (debug flavors)."""
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    """Length of the RoPE table; train.py sets it to training.seq_len."""
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        """Shapes that cannot build a model (ValueError, reported as the run's error line)."""
        if (
            min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_hidden_dim)
            < 1
        ):
            raise ValueError("dim, n_layers, n_heads, n_kv_heads, head_dim and ffn_hidden_dim must be >= 1")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads}")


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (batch, seq, heads, head_dim) with cos/sin (seq, head_dim / 2), in float32."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # QK-norm: RMSNorm over each head's query and key vectors, before RoPE.
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.kernel = CausalAttentionKernel()
        self.n_heads = args.n_heads

    def qk_clip_scales(self, clip: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scales of the QK-norm weights that multiply head h's attention logits by at most clip[h]
        (MuonClip, training/qk_clip.py). The norms normalize each head's query and key, so their
        weights, which every head shares, set the logits' scale: each takes the square root of the
        smallest factor, and every head's logits shrink by that factor."""
        shared = clip.min().sqrt()
        return {name: shared.expand(self.head_dim) for name in ("q_norm.weight", "k_norm.weight")}

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = cos[:seq], sin[:seq]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_norm(self.wq(x).view(batch, seq, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seq, -1, self.head_dim))
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


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
    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.out_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # depth-scaled init of residual writers

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
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); see models/llama3/model.py for the
        meaning of positions and of missing embedding/norm/output (pipeline stages)."""
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
        device = self.rope_cos.device
        if positions is None:
            positions = torch.arange(self.args.max_seq_len)
        exponents = torch.arange(0, self.args.head_dim, 2, dtype=torch.float32) / self.args.head_dim
        freqs = (1.0 / self.args.rope_theta**exponents).to(device)
        angles = torch.outer(positions.to(device, torch.float32), freqs)
        self.rope_cos, self.rope_sin = angles.cos(), angles.sin()

    def init_weights(self) -> None:
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
        """6 x matmul parameters (all but the embedding table) + causal attention, whose width is
        n_heads x head_dim here (not dim)."""
        params = sum(p.numel() for p in self.parameters())
        if not self.args.tie_embeddings:
            params -= self.tok_embeddings.weight.numel()
        attention = 6 * self.args.n_layers * seq_len * self.args.n_heads * self.args.head_dim
        return 6 * params + attention
