"""DeepSeek-V3 (and V2, Moonlight, Kimi K2, which share its decoder), in plain PyTorch:
Multi-head Latent Attention, a few dense blocks then Mixture-of-Experts blocks with shared experts
(models/moe.py), YaRN RoPE (models/rope.py), and multi-token prediction.

Multi-head Latent Attention (MLA). Queries come through a low-rank path (down to q_lora_rank, an
RMSNorm, up to every head) or one projection when q_lora_rank is 0. Keys and values come from one
compressed latent per token: a down-projection to kv_lora_rank values, normalized, plus one RoPE
key of qk_rope_head_dim values shared by all heads; an up-projection expands the latent into each
head's key (without RoPE) and value. A head's key is its qk_nope_head_dim no-RoPE part followed by
the shared RoPE part; its value has v_head_dim values, which may differ. RoPE rotates interleaved
pairs, as DeepSeek's checkpoints lay them out. The latent goes through
models.attention.LatentAttentionKernel, which expands it, so that context parallelism can move the
latent instead of the keys and values.

Multi-token prediction (MTP, mtp_depth > 0). MTP module k predicts the token k + 1 positions
ahead: it normalizes the previous depth's hidden state (the main model's for k = 1, before its
final norm) and the embedding of the token k positions ahead, projects the two (embedding first,
as DeepSeek's released weights and the inference engines read them) back to the model width, runs
one MoE block, and predicts through the main model's output head after a norm of its own. Its
modules sit in `layers` after the main blocks (keys n_layers ... n_layers + mtp_depth - 1, as
DeepSeek's checkpoints number them), so FSDP, activation checkpointing and compile wrap them like
any block; pipeline parallelism keeps them, and a copy of the embedding, on the last stage
(ModelSpec.last_stage). The training step passes the tokens ahead (`mtp_tokens`) and weighs the
depths' losses (training/loss.py); without them forward returns the main logits alone.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMask, LatentAttentionKernel
from models.moe import MoE, MoEArgs
from models.rope import Yarn, attention_temperature, rope_amplitude, rope_frequencies


@dataclass
class DeepseekV3Args:
    dim: int
    n_layers: int
    """Main blocks; the MTP modules come on top."""
    n_heads: int
    vocab_size: int
    """0 = the tokenizer's vocabulary size, rounded up to a multiple of 64 (debug flavors)."""
    ffn_hidden_dim: int
    """Hidden width of the dense blocks' SwiGLU."""
    first_k_dense: int
    """The first this many blocks have a dense feed-forward, the rest MoE layers."""
    # Multi-head Latent Attention
    q_lora_rank: int = 0
    """Rank of the queries' low-rank path; 0: one projection (DeepSeek-V2-Lite, Moonlight)."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE and YaRN (models/rope.py)
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    """YaRN's context extension factor; 1: plain RoPE."""
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    """Length of the RoPE table; train.py sets it to training.seq_len."""
    # Routed experts: models.moe.MoEArgs documents each one.
    n_experts: int = 8
    top_k: int = 2
    expert_hidden_dim: int = 64
    score_func: str = "sigmoid"
    renormalize: bool = True
    route_scale: float = 1.0
    n_expert_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2_sum"
    shared_hidden_dim: int = 0
    bias_update_rate: float = 0.0
    aux_loss_coeff: float = 0.0
    # Multi-token prediction
    mtp_depth: int = 0
    """MTP modules (DeepSeek-V3: 1); 0: none is built."""
    mtp_loss_weight: float = 0.1
    """Weight of the MTP losses' mean over the depths in the objective (DeepSeek-V3: 0.3 for its
    first 10T tokens, then 0.1)."""

    def __post_init__(self) -> None:
        """Shapes that cannot build a model (ValueError, reported as the run's error line)."""
        if min(self.dim, self.n_layers, self.n_heads, self.ffn_hidden_dim, self.kv_lora_rank) < 1:
            raise ValueError("dim, n_layers, n_heads, ffn_hidden_dim and kv_lora_rank must be >= 1")
        if min(self.qk_nope_head_dim, self.v_head_dim, self.q_lora_rank, self.mtp_depth) < 0:
            raise ValueError("qk_nope_head_dim, v_head_dim, q_lora_rank and mtp_depth must be >= 0")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and >= 2 (RoPE)")
        if not 0 <= self.first_k_dense <= self.n_layers:
            raise ValueError(
                f"first_k_dense {self.first_k_dense} must be between 0 and n_layers {self.n_layers}"
            )
        if self.mtp_loss_weight < 0:
            raise ValueError(f"mtp_loss_weight {self.mtp_loss_weight} must be >= 0")
        self.moe()  # the experts' own checks (top_k vs n_experts, groups, ...)

    def moe(self) -> MoEArgs:
        return MoEArgs.of(self)

    def yarn(self) -> Yarn:
        return Yarn(self.rope_factor, self.rope_original_seq_len, self.rope_beta_fast, self.rope_beta_slow,
                    self.rope_mscale, self.rope_mscale_all_dim)  # fmt: skip

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x (batch, seq, heads, dim) by position, in
    float32 (cos/sin: (seq, dim / 2)): x * (c, c) + (x[2i+1], x[2i]) * (-s, s)."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = torch.stack((-sin, sin), dim=-1).flatten(-2).unsqueeze(-2)
    x_float = x.float()
    swapped = x_float.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x_float * cos + swapped * sin).type_as(x)


class Attention(nn.Module):
    """Multi-head Latent Attention (the module docstring describes it)."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.kv_lora_rank = args.kv_lora_rank
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=1e-6)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=1e-6)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.kernel = LatentAttentionKernel()
        # The kernel scales logits by qk_head_dim^-1/2; YaRN's temperature multiplies the queries.
        self.query_scale = attention_temperature(args.yarn())
        self.n_heads = args.n_heads

    def qk_clip_scales(self, clip: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scales along dim 0 that multiply head h's attention logits by clip[h] (MuonClip,
        training/qk_clip.py; Kimi K2's for MLA): the head's no-RoPE query and key rows (of the query
        projection and of wkv_b) by its square root, its RoPE query rows by the whole factor; the
        RoPE key, which every head shares (wkv_a), and the values stay."""
        root = clip.sqrt()[:, None]
        query = torch.cat([root.expand(-1, self.nope_dim), clip[:, None].expand(-1, self.rope_dim)], dim=1)
        key_value = torch.cat(
            [root.expand(-1, self.nope_dim), torch.ones_like(root).expand(-1, self.v_dim)], dim=1
        )
        projection = "wq.weight" if hasattr(self, "wq") else "wq_b.weight"
        return {projection: query.flatten(), "wkv_b.weight": key_value.flatten()}

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = cos[:seq], sin[:seq]
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q_nope, q_rope = q.view(batch, seq, -1, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], -1
        )
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        compressed, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).squeeze(2)
        latent = torch.cat([self.kv_norm(compressed), k_rope], dim=-1)
        out = self.kernel(q.transpose(1, 2), latent, self.expand, mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent (batch, seq, kv_lora_rank + rope dim) -> K, V (batch, heads, seq, dims): each
        head's key is its expanded no-RoPE part and the shared RoPE key."""
        batch, seq, _ = latent.shape
        compressed, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(compressed).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def init_weights(self, out_std: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                nn.init.trunc_normal_(getattr(self, name).weight, mean=0.0, std=0.02)
        for norm in ("q_norm", "kv_norm"):
            if hasattr(self, norm):
                getattr(self, norm).reset_parameters()
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU of the dense blocks: w2(silu(w1 x) * w3 x)."""

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
    def __init__(self, layer_id: int, args: DeepseekV3Args):
        super().__init__()
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))  # depth-scaled init of residual writers
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if layer_id < args.first_k_dense:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        else:
            self.moe = MoE(args.dim, args.moe(), out_init_std=self.out_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        ffn = self.feed_forward if hasattr(self, "feed_forward") else self.moe
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        if hasattr(self, "feed_forward"):
            self.feed_forward.init_weights(self.out_std)
        else:
            self.moe.init_weights()


class MultiTokenPrediction(TransformerBlock):
    """One MTP depth: a block whose input combines the previous depth's hidden state with the
    embedding of the token ahead, and whose output has a norm of its own before the shared head."""

    def __init__(self, layer_id: int, args: DeepseekV3Args):
        super().__init__(layer_id, args)
        self.embedding_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hidden_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.projection = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.head_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """hidden: the previous depth's hidden state; embedded: the tokens ahead's embeddings."""
        x = self.projection(torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)], dim=-1))
        return super().forward(x, cos, sin, mask)

    def init_weights(self) -> None:
        super().init_weights()
        for norm in (self.embedding_norm, self.hidden_norm, self.head_norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.projection.weight, mean=0.0, std=0.02)


class Transformer(nn.Module):
    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        blocks = {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        mtp = {
            str(i): MultiTokenPrediction(i, args)
            for i in range(args.n_layers, args.n_layers + args.mtp_depth)
        }
        # A dict keyed by layer index keeps names such as `layers.7` when pipeline stages drop layers.
        self.layers = nn.ModuleDict(blocks | mtp)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        rope = args.qk_rope_head_dim // 2
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, rope), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, rope), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: AttentionMask | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """tokens (batch, seq) -> logits (batch, seq, vocab); see models/llama3/model.py for the
        meaning of positions and of missing embedding/norm/output (pipeline stages).

        mtp_tokens (batch, mtp_depth, seq): row k - 1 holds the tokens k positions ahead of
        `tokens`. Given (training), the result is a tuple: the main logits, then each MTP depth's.
        """
        if positions is None:
            cos, sin = self.rope_cos, self.rope_sin
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        # A pipeline stage without the embedding gets hidden states; so does the last one, which
        # holds the embedding for the MTP modules (ModelSpec.last_stage): told apart by dtype.
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)
        mtp = []
        for key, layer in self.layers.items():
            if int(key) < self.args.n_layers:
                h = layer(h, cos, sin, attention_mask)
            else:
                mtp.append(layer)
        if self.output is None:  # a pipeline stage before the last
            return self.norm(h) if self.norm is not None else h
        logits = self.output(self.norm(h))
        if mtp_tokens is None or not mtp:
            return logits
        depths = [logits]
        for depth, layer in enumerate(mtp):
            h = layer(h, self.tok_embeddings(mtp_tokens[:, depth]), cos, sin, attention_mask)
            depths.append(self.output(layer.head_norm(h)))
        return tuple(depths)

    def init_buffers(self, positions: torch.Tensor | None = None) -> None:
        device = self.rope_cos.device
        if positions is None:
            positions = torch.arange(self.args.max_seq_len)
        yarn = self.args.yarn()
        frequencies = rope_frequencies(self.args.qk_rope_head_dim, self.args.rope_theta, yarn).to(device)
        angles = torch.outer(positions.to(device, torch.float32), frequencies)
        amplitude = rope_amplitude(yarn)
        self.rope_cos, self.rope_sin = angles.cos() * amplitude, angles.sin() * amplitude
        for layer in self.layers.values():
            if hasattr(layer, "moe"):
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

    def active_parameters(self, mtp: bool = True) -> int:
        """Parameters one token goes through: all but the routed experts its router did not
        choose (mtp=False: without the MTP modules)."""
        total = 0
        for name, param in self.named_parameters():
            layer = name.split(".")[1] if name.startswith("layers.") else None
            if layer is not None and int(layer) >= self.args.n_layers and not mtp:
                continue
            total += param.numel()
        for key, layer in self.layers.items():
            if hasattr(layer, "moe") and (mtp or int(key) < self.args.n_layers):
                total -= sum(p.numel() for p in layer.moe.parameters()) - layer.moe.active_parameters()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active matmul parameters (the embedding table aside) + causal attention, whose
        width per layer is n_heads x (qk_head_dim + v_head_dim) / 2 (scores and values)."""
        params = self.active_parameters() - self.tok_embeddings.weight.numel()
        width = self.args.n_heads * (self.args.qk_head_dim + self.args.v_head_dim) / 2
        layers = self.args.n_layers + self.args.mtp_depth
        return 6 * params + 6 * layers * seq_len * width
