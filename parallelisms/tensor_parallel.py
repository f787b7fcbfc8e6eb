"""Tensor parallelism: apply a model's plan, keep tied weights tied, and loss parallelism.

The per-model plan (which layer is column- or row-wise) lives in the model's folder
(models/<name>/parallelize.py); this file holds what every model shares.
"""

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)

from models.spec import ModelSpec
from parallelisms.tied_weights import retie, tied_parameter_names


def apply_tensor_parallel(
    model: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh, loss_parallel: bool
) -> None:
    groups = tied_parameter_names(model)
    spec.parallelize_plan(model, tp_mesh, loss_parallel)
    retie(model, groups)  # the plan replaces parameters module by module, which unties them


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocabulary-sharded logits; forward and backward must both run inside."""
    return loss_parallel() if enabled else contextlib.nullcontext()


class FreshLocalOutput(ParallelStyle):
    """A style whose local-tensor output is copied into a tensor of its own.

    A style with use_local_output returns a view of its DTensor's local shard. When that view is
    the input of a compiled region (here: the embedding's output entering the first compiled
    block), torch 2.13's AOT autograd routes its gradient past the view into DTensor's
    redistribute as a plain tensor, and the backward fails (`'Tensor' object has no attribute
    '_local_tensor'`). The copy, one sequence-sharded activation per step, keeps the two apart.
    (The loss is therefore not compiled under TP: copying the replicated logits would cost more
    memory than compiling it saves.)
    """

    def __init__(self, style: ParallelStyle):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.style._apply(module, device_mesh)
        module.register_forward_hook(lambda _module, _inputs, output: output.clone())
        return module


# Megatron-style plans with sequence parallelism for the common decoder layout (tok_embeddings,
# layers.N with attention_norm / attention.wq..wo / ffn_norm / feed_forward.w1..w3, norm, output),
# which a model's parallelize.py applies and extends. Between blocks the residual stream is
# sharded over the sequence (Shard(1)); each norm runs on its sequence shard; attention and
# feed-forward gather the sequence, split heads / hidden units (column-wise in, row-wise out) and
# reduce-scatter back to sequence shards. The output projection is column-wise over the
# vocabulary: with loss parallelism the logits stay sharded.


def decoder_root_plan(loss_parallel: bool) -> dict[str, ParallelStyle]:
    return {
        # Its output enters the first (possibly compiled) block.
        "tok_embeddings": FreshLocalOutput(
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        ),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def decoder_tensor_parallel_sizes(args) -> dict[str, int]:
    """Sizes the decoder plans split over tp, which the degree must divide (args with n_heads,
    n_kv_heads, ffn_hidden_dim and vocab_size)."""
    return {
        "model n_heads": args.n_heads,
        "model n_kv_heads": args.n_kv_heads,
        "model ffn_hidden_dim": args.ffn_hidden_dim,
        "the vocabulary size": args.vocab_size,
    }


def decoder_block_plan() -> dict[str, ParallelStyle]:
    return {
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
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
