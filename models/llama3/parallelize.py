"""How Llama 3 is split by tensor parallelism (Megatron-style, with sequence parallelism).

Between blocks the residual stream is sharded over the sequence (Shard(1)); each norm runs on its
sequence shard; attention and feed-forward gather the sequence, split heads / hidden units
(column-wise in, row-wise out) and reduce-scatter back to sequence shards. The output projection is
column-wise over the vocabulary: with loss parallelism the logits stay sharded.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from models.llama3.model import Llama3Args


def tensor_parallel_sizes(args: Llama3Args) -> dict[str, int]:
    """Sizes that the tensor-parallel degree must divide."""
    return {
        "model n_heads": args.n_heads,
        "model n_kv_heads": args.n_kv_heads,
        "model ffn_hidden_dim": args.ffn_hidden_dim,
        "the vocabulary size": args.vocab_size,
    }


def apply_tensor_parallel_plan(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # (x, cos, sin): gather x over the sequence; the RoPE tables are plain tensors.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
