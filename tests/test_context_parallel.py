"""Context-parallel sequence split and its checks (the multi-rank parity runs are in test_parallel.py)."""

import pytest
import torch
from torch import nn

from configs import UserError, load_config
from parallelisms.context_parallel import apply_context_parallel, local_positions, shard_sequences
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


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_attention_equals_full_causal_attention(cp):
    from parallelisms.context_parallel import attend_local_chunks

    q, k, v = torch.randn(2, 4, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for rank in range(cp):
        positions = local_positions(32, rank, cp)
        torch.testing.assert_close(
            attend_local_chunks(q[:, :, positions], k, v, rank, cp), full[:, :, positions]
        )
