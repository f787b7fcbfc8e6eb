"""Where the standard decoder layout that Llama 3 and Qwen3 share is cut: its pipeline ends and
its tensor-parallel plan. The names here (tok_embeddings, layers.N.attention.wq ..., norm, output)
are the models' own, so the plans live beside the models, not in parallelisms/.

Tensor parallelism is Megatron-style with sequence parallelism: between blocks the residual stream
is sharded over the sequence (Shard(1)); each norm runs on its sequence shard; attention and
feed-forward gather the sequence, split heads / hidden units (column-wise in, row-wise out) and
reduce-scatter back to sequence shards. The output projection is column-wise over the vocabulary:
with loss parallelism the logits stay sharded.
"""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from models.spec import TensorParallelPlan

HEAD = ("tok_embeddings",)
TAIL = ("norm", "output")


def root_plan(loss_parallel: bool) -> dict[str, ParallelStyle]:
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def block_plan() -> dict[str, ParallelStyle]:
    return {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin): gather x over the sequence; the RoPE tables are plain tensors (and the
        # attention mask, a keyword argument, is left alone).
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def decoder_plan(args, loss_parallel: bool) -> TensorParallelPlan:
    return TensorParallelPlan(root=root_plan(loss_parallel), block=block_plan())


def tensor_parallel_sizes(args) -> dict[str, int]:
    """Sizes the decoder plan splits over tp, which the degree must divide."""
    return {
        "model n_heads": args.n_heads,
        "model n_kv_heads": args.n_kv_heads,
        "model ffn_hidden_dim": args.ffn_hidden_dim,
        "the vocabulary size": args.vocab_size,
    }
