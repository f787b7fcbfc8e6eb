"""Context parallelism: the sequence of every sample is split over the cp ranks.

Load balance for causal attention: the sequence is cut into 2 x cp chunks and rank r holds chunks
r and 2 x cp - 1 - r, so every rank has the same amount of attention work (an early chunk attends
to few keys, its partner late chunk to many). Inputs, labels and RoPE positions follow the split;
the loss is summed over the cp ranks like over data-parallel ranks.

Attention: each rank all-gathers K and V (small under GQA) from the cp group into sequence order.
Each of its two query chunks attends to its own chunk's keys with the plain causal mask (local:
computed while K/V are gathered) and to all keys before the chunk without a mask; the two parts are
merged by log-sum-exp (parallelisms/attention_parts.py), so every part runs on the kernel of plain
causal attention (cuDNN on the H200) instead of a lower-right-masked one. In backward, the gathered
keys' gradients are computed first and reduce-scattered to their owners while the local parts'
gradients are computed. With a document mask (models/attention.py) a rank's queries attend to the
gathered keys under the mask built for their positions. Attention with sinks (gpt-oss) does the
same with the mask its model built (causal, within a window, documents); in a sliding block each
query chunk attends only to the keys from its window's start to its own end, so its work does not
grow with the sequence (on CUDA the block mask's tiles outside the window are skipped instead).
Works on gloo (CPU) and NCCL (CUDA) alike.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from configs import UserError
from models.attention import (
    AttentionMask,
    CausalAttentionKernel,
    LatentAttentionKernel,
    SinkAttentionKernel,
    masked_attention,
    sink_attention,
)
from parallelisms.attention_parts import merge, part_backward, part_forward


def local_positions(seq_len: int, cp_rank: int, cp_degree: int) -> torch.Tensor:
    """Positions (within a sequence) of the tokens that this cp rank holds, in its local order."""
    chunk = seq_len // (2 * cp_degree)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_degree - 1 - cp_rank) * chunk, (2 * cp_degree - cp_rank) * chunk)
    return torch.cat([first, second])


def shard_sequences(batch: dict, positions: torch.Tensor) -> dict:
    """This rank's part of a batch's inputs and labels (the last dimension is the sequence; labels
    of multi-token prediction have a depth dimension before it)."""
    return {**batch, "input": batch["input"][..., positions], "labels": batch["labels"][..., positions]}


class _GatherChunks(torch.autograd.Function):
    """K/V of the whole sequences (gathered, in sequence order); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, exchange: "KVExchange") -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.finish_gather(exchange.start_gather(kv))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        by_rank = rank_order(grad, ctx.exchange.degree).contiguous()
        return ctx.exchange.finish_scatter(ctx.exchange.start_scatter(by_rank)), None


def sequence_order(by_rank: torch.Tensor) -> torch.Tensor:
    """(cp, 2, batch, kv_heads, 2 x chunk, dim) as gathered, rank j holding chunks j and 2cp-1-j
    -> (2, batch, kv_heads, seq, dim) in sequence order, in one copy (one concatenation)."""
    halves = by_rank.unflatten(-2, (2, -1))
    degree = by_rank.shape[0]
    firsts = [halves[rank, :, :, :, 0] for rank in range(degree)]
    seconds = [halves[rank, :, :, :, 1] for rank in reversed(range(degree))]
    return torch.cat(firsts + seconds, dim=3)


def rank_order(sequence: torch.Tensor, degree: int) -> torch.Tensor:
    """The inverse of sequence_order."""
    chunks = sequence.unflatten(3, (2 * degree, -1)).permute(3, 0, 1, 2, 4, 5)
    return torch.stack([chunks[:degree], chunks[degree:].flip(0)], dim=4).flatten(4, 5)


def prefix_gradients_by_rank(parts: list[tuple[int, torch.Tensor, torch.Tensor]], seq: int, degree: int):
    """The gathered keys' gradients, ready to reduce-scatter: (cp, 2, batch, kv_heads, 2 x chunk,
    dim) in rank order, the sum of the parts' (start, dk, dv), each the K and V gradients of the
    keys before `start` (zeros where no part reaches). On CUDA one compiled kernel reads each
    part once and writes the result; eagerly (CPU) the padding, sum and reorder are passes apart."""
    gradients = _prefix_gradients_by_rank_compiled() if parts[0][1].is_cuda else _prefix_gradients_by_rank
    return gradients(parts, seq, degree)


def _prefix_gradients_by_rank(parts, seq: int, degree: int) -> torch.Tensor:
    # Padded and summed, not added into slices of zeros: inductor makes this one kernel (slice
    # adds became a pass over all keys each, measured); eagerly it costs a few passes more.
    padded = [F.pad(torch.stack([dk, dv]), (0, 0, 0, seq - start)) for start, dk, dv in parts]
    return rank_order(sum(padded[1:], padded[0]), degree).contiguous()


@functools.cache
def _prefix_gradients_by_rank_compiled():
    return torch.compile(_prefix_gradients_by_rank, dynamic=False)


class KVExchange:
    """The cp group's collectives for attention, started and finished apart so that computation
    runs in between: every rank's K/V gathered into sequence order, and their gradients
    reduce-scattered back to their owners."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, degree: int):
        self.group, self.rank, self.degree = group, rank, degree

    def start_gather(self, kv: torch.Tensor):
        """kv: (2, batch, kv_heads, 2 x chunk, dim), this rank's K and V."""
        # Ranks concatenated along dimension 0 (gloo wants no new dimension).
        gathered = kv.new_empty((self.degree * kv.shape[0], *kv.shape[1:]))
        work = dist.all_gather_into_tensor(gathered, kv.contiguous(), group=self.group, async_op=True)
        return gathered.unflatten(0, (self.degree, -1)), work

    def finish_gather(self, pending) -> torch.Tensor:
        """-> (2, batch, kv_heads, seq, dim): K and V of the whole sequences."""
        gathered, work = pending
        work.wait()
        return sequence_order(gathered)

    def start_scatter(self, by_rank: torch.Tensor):
        """by_rank: (cp, 2, batch, kv_heads, 2 x chunk, dim), contiguous: the whole sequences' K/V
        gradients in rank order (rank_order), to be summed over the ranks."""
        out = by_rank.new_empty(by_rank.shape[1:])
        work = dist.reduce_scatter_tensor(
            out, by_rank.flatten(0, 1), op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )
        return out, work

    def finish_scatter(self, pending) -> torch.Tensor:
        """-> (2, batch, kv_heads, 2 x chunk, dim): this rank's share of the K/V gradients."""
        out, work = pending
        work.wait()
        return out


class WholeSequenceExchange(KVExchange):
    """Stands in for the cp group in one process that holds the whole sequences' K/V (tests,
    benchmarks/benchmark_attention.py): nothing is communicated, and the gradients meant for the
    keys' owners are kept (`scattered`, in sequence order; this rank's share is returned as zeros)."""

    def __init__(self, kv: torch.Tensor, rank: int, degree: int):
        super().__init__(None, rank, degree)
        self.kv, self.scattered_by_rank = kv, None

    @property
    def scattered(self) -> torch.Tensor:
        return sequence_order(self.scattered_by_rank)

    def start_gather(self, kv: torch.Tensor):
        return self.kv

    def finish_gather(self, pending) -> torch.Tensor:
        return pending

    def start_scatter(self, by_rank: torch.Tensor):
        self.scattered_by_rank = by_rank
        return torch.zeros_like(by_rank[self.rank])

    def finish_scatter(self, pending) -> torch.Tensor:
        return pending


def causal_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exchange: KVExchange):
    """Exact causal attention of a cp rank's two query chunks (q, k, v: this rank's chunks)."""
    return _CausalChunkAttention.apply(q, k, v, exchange)


class _CausalChunkAttention(torch.autograd.Function):
    """Exact causal attention of a cp rank's two query chunks, each split in two parts: its own
    chunk's keys (square causal mask; local, so computed while K/V are gathered) and every key
    before the chunk (no mask), merged by log-sum-exp (parallelisms/attention_parts.py). Backward
    computes the gathered keys' gradients first and reduce-scatters them while the local parts'
    gradients are computed. The two chunks' squares (equal shapes) run as one batched kernel call."""

    @staticmethod
    def forward(ctx, q, k, v, exchange: KVExchange):
        pending = exchange.start_gather(torch.stack([k, v]))
        # Both chunks' own squares in one kernel call: the two chunks as a batch of twice the size.
        own_out, own_lse = part_forward(*map(_chunks_as_batch, (q, k, v)), causal=True)
        own = list(zip(_batch_as_chunks(own_out).unbind(2), _batch_as_chunks(own_lse).unbind(2)))
        keys, values = exchange.finish_gather(pending)
        output = torch.empty_like(q)
        lses = []
        for query, own_part, start, into in zip(
            q.chunk(2, 2), own, _chunk_starts(q, exchange), output.chunk(2, 2)
        ):
            parts = [own_part]
            if start:
                parts.append(part_forward(query, keys[:, :, :start], values[:, :, :start], causal=False))
            lses.append(merge(parts, into)[1])
        ctx.exchange = exchange
        ctx.save_for_backward(q, k, v, keys, values, output, *lses)
        return output

    @staticmethod
    def backward(ctx, dout):
        q, k, v, keys, values, output, *lses = ctx.saved_tensors
        outs, queries = output.chunk(2, dim=2), q.chunk(2, dim=2)
        # Each chunk's output gradient made contiguous once (both its parts' kernels read it).
        douts = [d.contiguous() for d in dout.chunk(2, dim=2)]
        dq_before = [None, None]  # from the keys before each chunk
        before = []  # (start, dk, dv) of the keys before each chunk
        for i, start in enumerate(_chunk_starts(q, ctx.exchange)):
            if start:
                dq_before[i], dk_part, dv_part = part_backward(
                    douts[i], queries[i], keys[:, :, :start], values[:, :, :start], outs[i], lses[i], False
                )
                before.append((start, dk_part, dv_part))
        degree = ctx.exchange.degree
        pending = ctx.exchange.start_scatter(prefix_gradients_by_rank(before, keys.shape[2], degree))
        # The chunks' own squares: one batched kernel call, as in forward.
        dq_own, dk_local, dv_local = (
            _batch_as_chunks(grad).flatten(2, 3)
            for grad in part_backward(
                _chunks_as_batch(dout), *map(_chunks_as_batch, (q, k, v, output)),
                torch.stack(lses, dim=1).flatten(0, 1), causal=True,
            )
        )  # fmt: skip
        for i in range(2):
            if dq_before[i] is not None:
                dq_own.chunk(2, dim=2)[i].add_(dq_before[i])
        dk, dv = ctx.exchange.finish_scatter(pending)
        return dq_own, dk_local.add_(dk), dv_local.add_(dv), None


def _chunks_as_batch(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, 2 x chunk, ...) -> (batch x 2, heads, chunk, ...): the rank's two chunks of
    each sequence as two samples (a view where the layout allows, e.g. batch 1)."""
    return t.unflatten(2, (2, -1)).transpose(1, 2).flatten(0, 1)


def _batch_as_chunks(t: torch.Tensor) -> torch.Tensor:
    """(batch x 2, heads, chunk, ...) -> (batch, heads, 2, chunk, ...), the inverse of
    _chunks_as_batch up to flattening dimensions 2 and 3; indexing dimension 2 gives a chunk."""
    return t.unflatten(0, (-1, 2)).transpose(1, 2)


def _chunk_starts(q: torch.Tensor, exchange: KVExchange) -> list[int]:
    """Sequence positions where the rank's two chunks (rank and 2cp-1-rank) begin."""
    chunk = q.shape[2] // 2
    return [exchange.rank * chunk, (2 * exchange.degree - 1 - exchange.rank) * chunk]


class ContextParallelAttention(nn.Module):
    def __init__(self, exchange: KVExchange):
        super().__init__()
        self.exchange = exchange

    @torch.compiler.disable  # collectives started and finished apart: run eagerly, between graphs
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        if mask is None:
            return causal_chunk_attention(q, k, v, self.exchange)
        # A document mask, built for this rank's query positions, against the gathered keys.
        keys, values = _GatherChunks.apply(torch.stack([k, v]), self.exchange)
        return masked_attention(q, keys, values, mask)


class ContextParallelLatentAttention(nn.Module):
    """Multi-head Latent Attention (models.attention.LatentAttentionKernel) under context
    parallelism: each rank all-gathers every token's latent (kv_lora_rank + RoPE dims values,
    far fewer than the heads' keys and values) into sequence order, expands it into K and V for the
    whole sequence, and its query chunks attend to them under the causal mask of their positions
    (or the document mask built for them). Backward reduce-scatters the latent's gradient to its
    owners; the expansion's weight gradients are summed with the other ranks' by FSDP, whose mesh
    spans the cp ranks. (The keys' and values' head dims differ, so the two-part kernel of
    ContextParallelAttention, which gathers them stacked, does not apply.)"""

    def __init__(self, exchange: KVExchange):
        super().__init__()
        self.exchange = exchange

    @torch.compiler.disable  # collectives: run eagerly, between graphs
    def forward(self, q: torch.Tensor, latent: torch.Tensor, expand, mask: AttentionMask | None = None):
        # (batch, 2 x chunk, width) as (1, batch, 1, 2 x chunk, width): one tensor, one "head".
        gathered = _GatherChunks.apply(latent.unsqueeze(0).unsqueeze(2), self.exchange)[0, :, 0]
        keys, values = expand(gathered)
        if mask is None:
            positions = local_positions(gathered.shape[1], self.exchange.rank, self.exchange.degree)
            mask = torch.arange(gathered.shape[1]).unsqueeze(0) <= positions.unsqueeze(1)
            mask = mask.to(q.device)
        return masked_attention(q, keys, values, mask)


class ContextParallelSinkAttention(nn.Module):
    """Attention with sinks (models.attention.SinkAttentionKernel, gpt-oss) under context
    parallelism: every rank's K and V all-gathered into sequence order, this rank's queries attending
    to them under the mask its model built for their positions against the whole sequence (causal
    or documents, within the window in sliding blocks); backward reduce-scatters the K/V gradients.
    The sinks join each query's softmax as without CP.

    In a sliding block (window set) each of the rank's two query chunks attends only to the keys
    from window - 1 before its first position to its last: the parts of the sequence wholly outside
    its window are skipped, not computed and masked, so the work is chunk x (chunk + window - 1)
    whatever the sequence length. On CUDA the block mask already makes flex attention skip the tiles
    outside the window, and a block mask cannot be cut by keys, so it is used whole. All K and V are
    still gathered (docs/gpt_oss.md: an exchange of the window's keys alone is not written)."""

    def __init__(self, exchange: KVExchange, window: int | None = None):
        super().__init__()
        self.exchange, self.window = exchange, window

    @torch.compiler.disable  # collectives: run eagerly, between graphs
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        keys, values = _GatherChunks.apply(torch.stack([k, v]), self.exchange)
        if self.window is None or isinstance(mask, BlockMask):
            return sink_attention(q, keys, values, sinks, mask)
        chunk = q.shape[2] // 2
        outputs = []
        for index, start in enumerate(_chunk_starts(q, self.exchange)):
            queries = slice(index * chunk, (index + 1) * chunk)
            first_key = max(start - self.window + 1, 0)  # the window of the chunk's first query
            near = slice(first_key, start + chunk)  # to the chunk's last query, causal
            part_mask = mask[..., queries, near]
            outputs.append(
                sink_attention(q[:, :, queries], keys[:, :, near], values[:, :, near], sinks, part_mask)
            )
        return torch.cat(outputs, dim=2)


KERNELS = {
    CausalAttentionKernel: ContextParallelAttention,
    LatentAttentionKernel: ContextParallelLatentAttention,
    SinkAttentionKernel: ContextParallelSinkAttention,
}


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Swap every attention kernel of the model for its context-parallel one (hooks that other
    parallelisms put on the kernel, e.g. tensor parallelism's, stay on it)."""
    kernels = [(name, module) for name, module in model.named_modules() if type(module) in KERNELS]
    has_layers = any(True for _ in getattr(model, "layers", {}))  # a pipeline stage may hold none
    if not kernels and has_layers:
        raise UserError(
            "context parallelism needs the model's attention to call models.attention.CausalAttentionKernel "
            f"(or LatentAttentionKernel, SinkAttentionKernel); {type(model).__name__} has none"
        )
    for name, kernel in kernels:
        parent, _, child = name.rpartition(".")
        exchange = KVExchange(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
        window = {"window": kernel.window} if isinstance(kernel, SinkAttentionKernel) else {}
        swapped = KERNELS[type(kernel)](exchange, **window)
        swapped._forward_pre_hooks.update(kernel._forward_pre_hooks)
        setattr(model.get_submodule(parent), child, swapped)
