"""Attention kernels shared by the model families (plain PyTorch, no distributed code).

Causal attention by default. With document masking (`[model] attention_mask = "document"`) a token
attends only to earlier tokens of its own document in the packed window: the training step finds
the documents from the EOS tokens the packer writes (`document_ids`), builds one mask per
micro-batch (`document_mask`) and the model hands it, untouched, to every attention kernel. On CUDA
the mask is a flex-attention BlockMask (fully masked tiles are skipped: the shorter the documents,
the less work; flex's kernel is slower than the cuDNN one of causal attention, see
docs/performance.md); elsewhere it is a boolean tensor for SDPA (flex attention has no CPU backward).

Attention with sinks (gpt-oss, SinkAttentionKernel) always takes a mask, which its model builds
once per forward from the same pieces: `causal_mask` (or the document mask) for its full layers,
and `within_window` of it for its sliding-window layers.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    and_masks,
    create_block_mask,
    flex_attention,
)

AttentionMask = BlockMask | torch.Tensor
"""What `document_mask` builds and the kernels take; None means plain causal attention."""


class CausalAttentionKernel(nn.Module):
    """softmax(QK^T/sqrt(d)) V with a causal mask, through SDPA, or with a document mask.

    A module of its own so that parallelisms can swap it: context parallelism replaces every
    instance with its all-gather-KV version (parallelisms/context_parallel.py).
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        return causal_attention(q, k, v, mask)


class LatentAttentionKernel(nn.Module):
    """Attention whose keys and values the model expands from one small vector per token (DeepSeek's
    Multi-head Latent Attention): causal attention of q against expand(latent).

    A module of its own so that parallelisms can swap it: context parallelism gathers the latent
    (e.g. 576 values per token at DeepSeek-V3's shapes, against 128 heads x (192 + 128) for K and
    V) and expands it on every rank (parallelisms/context_parallel.py).
    """

    def forward(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """q (batch, heads, seq, head_dim); latent (batch, seq, width); expand(latent) -> K, V
        (batch, heads, seq, head_dim and value dim, which may differ from head_dim)."""
        k, v = expand(latent)
        return causal_attention(q, k, v, mask)


class SinkAttentionKernel(nn.Module):
    """Attention with a learned sink per head (gpt-oss): each query's softmax runs over its keys and
    one more logit, the head's sink, whose value is zero, so a head can give a token little or no
    attention. Which keys a query sees is the mask's to say (causal, a sliding window, documents).

    A module of its own so that parallelisms can swap it: context parallelism gathers K and V and
    attends this rank's queries with the same mask (parallelisms/context_parallel.py), only to the
    keys within `window` of them in a sliding block.
    """

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window
        """The sliding window that the block's mask holds (None: a full block). This kernel needs only
        the mask; the context-parallel one reads the window to skip the keys beyond it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """q (batch, heads, queries, head_dim); k, v may have fewer heads (GQA); sinks (heads,)."""
        return sink_attention(q, k, v, sinks, mask)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: AttentionMask
) -> torch.Tensor:
    """softmax([q k^T / sqrt(d), sink]) [v, 0] under the mask (True: attend). On CUDA with a block
    mask, flex attention: its tiles outside the mask (beyond a sliding window, other documents) are
    skipped, and the sink enters afterwards through flex's log-sum-exp L of the keys: the softmax
    with the sink is the one without it times exp(L) / (exp(L) + exp(sink)) = sigmoid(L - sink).
    Elsewhere (the CPU, tests), the scores are written out and the sink is one more column."""
    sinks = sinks.float().view(1, -1, 1)
    if isinstance(mask, BlockMask):
        flex = _compiled_flex_attention()
        out, aux = flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=_flex_tiles(q),
                        return_aux=AuxRequest(lse=True))  # fmt: skip
        return (out * torch.sigmoid(aux.lse - sinks).unsqueeze(-1)).to(q.dtype)
    heads = q.shape[1]
    keys, values = (t.float().repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = (q.float() @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    with_sink = torch.cat([scores, sinks.unsqueeze(-1).expand(*scores.shape[:-1], 1)], dim=-1)
    return (with_sink.softmax(dim=-1)[..., :-1] @ values).to(q.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None
) -> torch.Tensor:
    """q: (batch, heads, seq, head_dim); k, v may have fewer heads (GQA); causal without a mask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return masked_attention(q, k, v, mask)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Attention of q against k, v under a mask from `document_mask` (queries may be fewer)."""
    if isinstance(mask, BlockMask):
        options = _flex_tiles(q)
        return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# Flex attention's Triton tiles on Hopper in bf16/fp16 at head dimension 64 (the Llama 3 1B
# shape): forward 64x128 tiles instead of inductor's default 128x128, backward 64x64 tiles with 4
# warps instead of 64/128 with 8; the fastest that inductor's max-autotune found for
# document-masked attention at 8k tokens on an H200 (torch 2.11): the 1B document-masked step
# 45,500 -> 47,100 tok/s (docs/performance.md). At head dimension 128 the autotuned tiles gained
# nothing in the step; other GPUs, dtypes and head dimensions keep inductor's defaults.
_HOPPER_FLEX_TILES_HEAD_DIM_64 = {
    "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
    "bwd_num_stages": 3, "bwd_num_warps": 4,
}  # fmt: skip


def _flex_tiles(q: torch.Tensor) -> dict | None:
    """flex attention's kernel_options for q (None: inductor's defaults)."""
    if q.shape[-1] != 64 or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    if torch.cuda.get_device_properties(q.device).major != 9:  # Hopper
        return None
    return _HOPPER_FLEX_TILES_HEAD_DIM_64


@functools.cache
def _compiled_flex_attention():
    # Uncompiled, flex attention materializes the whole score matrix; compiled, it is one fused
    # kernel. Inside a compiled block this is simply inlined.
    return torch.compile(flex_attention)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) tokens -> (batch, seq) document index of every position: the number of EOS
    tokens before it (an EOS ends its own document; the window's first, partial document is 0)."""
    is_eos = (tokens == eos_id).to(torch.int32)
    return is_eos.cumsum(dim=1, dtype=torch.int32) - is_eos


def document_mask(documents: torch.Tensor, query_positions: torch.Tensor | None = None) -> AttentionMask:
    """The mask of causal attention within documents, for the device of `documents`.

    documents: (batch, seq) from `document_ids`, for the whole sequence (the keys).
    query_positions: (queries,) the sequence positions of the queries, in their order (default all
    of them; a context-parallel rank holds only some chunks of each sequence).
    """
    batch, seq = documents.shape
    queries = torch.arange(seq, device=documents.device) if query_positions is None else query_positions
    queries = queries.to(documents.device)
    if documents.device.type != "cuda":
        keys = torch.arange(seq, device=documents.device)
        causal = keys[None, :] <= queries[:, None]
        same_document = documents[:, queries, None] == documents[:, None, :]
        return (causal & same_document).unsqueeze(1)  # (batch, 1 = every head, queries, keys)

    def within_document(b, h, q_index, kv_index):
        position = queries[q_index]
        return (kv_index <= position) & (documents[b, position] == documents[b, kv_index])

    build = _compiled_create_block_mask()
    return build(within_document, batch, None, len(queries), seq, device=documents.device)


@functools.cache
def _compiled_create_block_mask():
    # Compiled, the mask is evaluated tile by tile instead of as a (queries x keys) boolean tensor.
    return torch.compile(create_block_mask)


def causal_mask(query_positions: torch.Tensor, key_count: int) -> AttentionMask:
    """The mask of causal attention of queries at `query_positions` (on the device the mask is for)
    against keys 0 .. key_count - 1: a block mask on CUDA, a boolean tensor elsewhere."""
    if query_positions.device.type != "cuda":
        keys = torch.arange(key_count, device=query_positions.device)
        return (keys[None, :] <= query_positions[:, None])[None, None]  # (1, 1, queries, keys)

    def causal(b, h, q_index, kv_index):
        return kv_index <= query_positions[q_index]

    build = _compiled_create_block_mask()
    return build(causal, None, None, len(query_positions), key_count, device=query_positions.device)


def within_window(mask: AttentionMask, query_positions: torch.Tensor, window: int) -> AttentionMask:
    """mask (causal_mask's or document_mask's, for queries at query_positions) restricted to a
    sliding window: a query at position p sees only keys p - window + 1 .. p. As a block mask, the
    tiles wholly outside the window are then skipped."""
    if isinstance(mask, torch.Tensor):
        keys = torch.arange(mask.shape[-1], device=mask.device)
        return mask & (query_positions[:, None] - keys[None, :] < window)

    def in_window(b, h, q_index, kv_index):
        return query_positions[q_index] - kv_index < window

    batch = mask.kv_num_blocks.shape[0] if mask.kv_num_blocks.shape[0] > 1 else None
    queries, keys = mask.seq_lengths
    build = _compiled_create_block_mask()
    device = mask.kv_num_blocks.device
    return build(and_masks(mask.mask_mod, in_window), batch, None, queries, keys, device=device)
