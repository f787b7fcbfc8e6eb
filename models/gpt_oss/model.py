"""gpt-oss (OpenAI's open-weight Mixture-of-Experts decoder), in plain PyTorch.

What sets it apart from Qwen3-MoE, block by block:
- Attention with sinks: every head has a learned logit, its sink, that joins each query's softmax
  with a value of zero, so a head may attend to almost nothing (models.attention.SinkAttentionKernel).
- Every other block, the first included, attends within a sliding window (128 tokens: the query
  and the 127 before it); the others attend to the whole causal context.
- Biases on the query, key, value and output projections, on the router and on the experts.
- The experts' clamped SwiGLU with gate and up projections in one interleaved weight
  (MoEArgs.expert_activation "clamped_swiglu", models/grouped_experts.py); softmax routing over
  the top_k experts' logits, which is the softmax over all of them renormalized over the top_k.
- RoPE over halves of each head (as Qwen3), YaRN-stretched (factor 32 over an original 4,096
  tokens, theta 150,000) without rounding the ramp's ends, cos and sin scaled by YaRN's
  temperature (models/rope.py).

The model builds its attention masks once per forward, for the positions of the tokens it holds
(init_buffers: all of them, or a context-parallel rank's chunks against the whole sequence): the
causal or document mask for full blocks, that mask within the window for sliding ones.
"""

from dataclasses import dataclass

import torch
from torch import nn

from models.attention import AttentionMask, SinkAttentionKernel, causal_mask, within_window
from models.grouped_experts import local_tensor
from models.moe import MoE, MoEArgs
from models.rope import Yarn, rope_amplitude, rope_frequencies


@dataclass
class GptOssArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    """0 = the tokenizer's vocabulary size, rounded up to a multiple of 64 (debug flavors)."""
    n_experts: int
    top_k: int
    expert_hidden_dim: int
    sliding_window: int = 128
    """Keys a query of a sliding block sees: itself and the window - 1 before it. Blocks 0, 2, 4,
    ... slide; 0: none does."""
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    """Length of the RoPE table; train.py sets it to training.seq_len."""
    # RoPE and YaRN (models/rope.py)
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    """YaRN's context extension factor; 1: plain RoPE."""
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    # Routing, balancing and the experts: models.moe.MoEArgs documents each one.
    score_func: str = "softmax"
    renormalize: bool = True
    route_scale: float = 1.0
    n_expert_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2_sum"
    shared_hidden_dim: int = 0
    bias_update_rate: float = 0.0
    aux_loss_coeff: float = 0.0
    router_bias: bool = True
    expert_activation: str = "clamped_swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        """Shapes that cannot build a model (ValueError, reported as the run's error line)."""
        if min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim) < 1:
            raise ValueError("dim, n_layers, n_heads, n_kv_heads and head_dim must be >= 1")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 0 (0: no sliding blocks)")
        self.moe()  # the experts' own checks (top_k vs n_experts, activation, ...)

    def moe(self) -> MoEArgs:
        return MoEArgs.of(self)

    def yarn(self) -> Yarn:
        return Yarn(self.rope_factor, self.rope_original_seq_len, self.rope_beta_fast, self.rope_beta_slow,
                    mscale=1.0, mscale_all_dim=0.0, truncate=False)  # fmt: skip

    def window(self, layer_id: int) -> int | None:
        """The sliding window of block layer_id, None for a block that attends to all it precedes."""
        return self.sliding_window if self.sliding_window and layer_id % 2 == 0 else None

    @property
    def ffn_hidden_dim(self) -> int:
        """Feed-forward width one token goes through (top_k experts)."""
        return self.top_k * self.expert_hidden_dim + self.shared_hidden_dim


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (batch, seq, heads, head_dim) with cos/sin (seq, head_dim / 2), in float32."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: GptOssArgs, window: int | None):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        """One logit per head that joins every query's softmax (a key whose value is zero)."""
        self.kernel = SinkAttentionKernel(window)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = cos[:seq], sin[:seq]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads (and of the sinks).
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        sinks = local_tensor(self.sinks)
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks, mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(linear.bias)
        nn.init.trunc_normal_(self.sinks, mean=0.0, std=0.02)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: GptOssArgs):
        super().__init__()
        self.window = args.window(layer_id)
        self.out_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # depth-scaled init of residual writers
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, self.window)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, args.moe(), out_init_std=self.out_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        self.moe.init_weights()


class Transformer(nn.Module):
    def __init__(self, args: GptOssArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        # The sequence positions of the tokens this model holds (init_buffers), for the masks.
        self.register_buffer("token_positions", torch.arange(args.max_seq_len), persistent=False)
        self.holds_whole_sequences = True

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); see models/llama3/model.py for the
        meaning of positions and of missing embedding/norm/output (pipeline stages).
        attention_mask: None (causal) or the document mask, for this model's tokens against all the
        sequence's (models.attention.document_mask)."""
        if positions is None:
            cos, sin = self.rope_cos, self.rope_sin
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Tokens held: hidden states may be sequence shards (tensor parallelism); a later pipeline
        # stage holds the whole training sequence (or a context-parallel rank's part of it).
        held = len(self.token_positions) if tokens.is_floating_point() else tokens.shape[1]
        masks = self.attention_masks(held, positions, attention_mask)
        for layer in self.layers.values():
            h = layer(h, cos, sin, masks[layer.window])
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def attention_masks(
        self, seq: int, positions: torch.Tensor | None, attention_mask: AttentionMask | None
    ) -> dict[int | None, AttentionMask]:
        """{window: mask} for the blocks of each window (None: full causal). The queries are the
        `seq` tokens held; the keys the whole sequence's, which a context-parallel rank gathers."""
        queries = self.token_positions[:seq] if positions is None else self.token_positions[positions]
        keys = seq if self.holds_whole_sequences else self.args.max_seq_len
        full = attention_mask if attention_mask is not None else causal_mask(queries, keys)
        masks = {None: full}
        if self.args.sliding_window:
            masks[self.args.sliding_window] = within_window(full, queries, self.args.sliding_window)
        return masks

    def init_buffers(self, positions: torch.Tensor | None = None) -> None:
        device = self.rope_cos.device
        self.holds_whole_sequences = positions is None
        if positions is None:
            positions = torch.arange(self.args.max_seq_len)
        self.token_positions = positions.to(device)
        yarn = self.args.yarn()
        frequencies = rope_frequencies(self.args.head_dim, self.args.rope_theta, yarn).to(device)
        angles = torch.outer(positions.to(device, torch.float32), frequencies)
        amplitude = rope_amplitude(yarn)
        self.rope_cos, self.rope_sin = angles.cos() * amplitude, angles.sin() * amplitude
        for layer in self.layers.values():
            layer.moe.init_buffers()

    def init_weights(self) -> None:
        std = self.args.dim**-0.5
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def active_parameters(self) -> int:
        """Parameters one token goes through: all but the experts its router did not choose."""
        total = sum(p.numel() for p in self.parameters())
        for layer in self.layers.values():
            total -= sum(p.numel() for p in layer.moe.parameters()) - layer.moe.active_parameters()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active matmul parameters (all but the embedding table and the experts not chosen) +
        attention: 12 x heads x head_dim per key a query sees, seq_len / 2 keys on average in a
        causal block, at most the window in a sliding one."""
        params = self.active_parameters() - self.tok_embeddings.weight.numel()
        width = self.args.n_heads * self.args.head_dim
        keys = 0.0
        for layer_id in range(self.args.n_layers):
            window = self.args.window(layer_id)
            if window is None or window >= seq_len:
                keys += seq_len / 2
            else:  # the first window - 1 queries see fewer keys than the window
                keys += (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
        return 6 * params + 12 * width * keys
