"""Context-parallel sequence split and its checks (the multi-rank parity runs are in test_parallel.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from configs import UserError, load_config
from parallelisms.context_parallel import (
    WholeSequenceExchange,
    apply_context_parallel,
    causal_chunk_attention,
    local_positions,
    rank_order,
    sequence_order,
    shard_sequences,
)
from parallelisms.parallel_dims import ParallelDims


def test_head_tail_chunks_cover_the_sequence_and_balance_causal_work():
    seq, cp = 16, 4
    parts = [local_positions(seq, r, cp) for r in range(cp)]
    assert parts[0].tolist() == [0, 1, 14, 15] and parts[1].tolist() == [2, 3, 12, 13]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # Causal work of a query is its position + 1 keys: every rank gets the same total.
    work = [int((p + 1).sum()) for p in parts]
    assert len(set(work)) == 1


def test_batches_follow_the_split():
    tokens = torch.arange(2 * 9).view(2, 9)
    batch = {"input": tokens[:, :-1], "labels": tokens[:, 1:], "sample_ids": torch.tensor([0, 1])}
    positions = local_positions(8, 1, 2)  # chunks 1 and 2 of 4
    part = shard_sequences(batch, positions)
    assert part["input"][0].tolist() == [2, 3, 4, 5] and part["labels"][0].tolist() == [3, 4, 5, 6]
    assert torch.equal(part["sample_ids"], batch["sample_ids"])


def dims(*argv, world=4):
    return ParallelDims.from_config(load_config(list(argv)).parallelism, world)


def test_sequence_length_checks():
    with pytest.raises(
        UserError, match=r"training.seq_len \(30\) must divide into 2 x context_parallel_degree = 8"
    ):
        dims("--parallelism.context_parallel_degree", "4").check_sequence_split(30)
    layout = dims(
        "--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4", world=8
    )
    with pytest.raises(
        UserError, match="tensor_parallel_degree 4 does not divide the 10 tokens per context-parallel"
    ):
        layout.check_sequence_split(20)
    dims("--parallelism.context_parallel_degree", "2").check_sequence_split(32)


def test_context_parallel_shards_fsdp_over_cp_ranks():
    layout = dims("--parallelism.context_parallel_degree", "2", world=2)
    assert (layout.dp, layout.cp, layout.fsdp_enabled) == (1, 2, True)


def test_model_without_the_shared_kernel_is_refused():
    class OwnAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})

    with pytest.raises(
        UserError, match="needs the model's attention to call models.attention.CausalAttentionKernel"
    ):
        apply_context_parallel(OwnAttention(), cp_mesh=None)


def test_rank_order_inverts_sequence_order():
    sequence = torch.arange(2 * 3 * 16).reshape(2, 1, 3, 16, 1).float()
    by_rank = rank_order(sequence, 4)
    assert by_rank.shape == (4, 2, 1, 3, 4, 1)
    for rank in range(4):  # each rank's chunks, as local_positions names them
        assert torch.equal(by_rank[rank], sequence[:, :, :, local_positions(16, rank, 4)])
    assert torch.equal(sequence_order(by_rank), sequence)


def check_chunk_attention(cp: int, device: str, dtype: torch.dtype, tolerance: dict) -> None:
    """Every cp rank's output and K/V/Q gradients (its own and those sent to the keys' owners),
    put together, equal plain causal SDPA's over the whole sequences."""
    torch.manual_seed(0)
    seq = 64 * cp
    # (batch, heads, seq, dim) views of (batch, seq, heads, dim) tensors, as the models make them.
    q, k, v = (
        torch.randn(2, seq, heads, 16, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        for heads in (4, 2, 2)
    )
    dout = torch.randn_like(q)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    full.backward(dout)
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
    for rank in range(cp):
        positions = local_positions(seq, rank, cp).to(device)
        local = [t[:, :, positions].detach().requires_grad_() for t in (q, k, v)]
        exchange = WholeSequenceExchange(torch.stack([k, v]).detach(), rank, cp)
        out = causal_chunk_attention(*local, exchange)
        torch.testing.assert_close(out, full[:, :, positions], **tolerance)
        out.backward(dout[:, :, positions])
        for total, leaf in zip(grads, local):
            total[:, :, positions] += leaf.grad.float()
        grads[1] += exchange.scattered[0].float()  # the gradients sent to the keys' owners
        grads[2] += exchange.scattered[1].float()
    for total, leaf in zip(grads, (q, k, v)):
        torch.testing.assert_close(total, leaf.grad.float(), **tolerance)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_attention_equals_full_causal_attention(cp):
    check_chunk_attention(cp, "cpu", torch.float32, {"rtol": 1e-5, "atol": 1e-5})
