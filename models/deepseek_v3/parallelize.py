"""How tensor parallelism splits the DeepSeek-V3 family: Multi-head Latent Attention by heads, the
dense and MoE feed-forwards as the other families split them, sequence parallelism between.

MLA. The attention's input is gathered over the sequence. The low-rank down-projections and their
norms (wq_a, q_norm, wkv_a, kv_norm) are small and stay whole on every rank, which computes them
on the same tokens; the up-projections (wq or wq_b, wkv_b) are split column-wise by heads and the
output projection row-wise, reduce-scattered back to sequence shards. A rank's heads use only their
part of the latent's gradient, and all of them share the RoPE key: the latent's gradient is summed
over the ranks where the attention kernel receives it (SumGradient), so the down-projections get
the whole gradient, the same on every rank, and wkv_b leaves its input's gradient alone
(HeadColumns). The queries' up-projection sums its input's gradient itself (ColwiseParallel).

The MTP modules' own norms and projection run on sequence shards (SequenceParallel); their block
is split like the others. Measured choices and byte counts: docs/deepseek_v3.md.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from models.decoder_plans import block_plan, root_plan
from models.deepseek_v3.model import DeepseekV3Args
from models.moe_plans import moe_plan
from models.spec import TensorParallelPlan


class HeadColumns(ParallelStyle):
    """A Linear split column-wise (its output features: whole heads) that computes on its local
    weight: a plain input, a plain output of the rank's features, and no reduction of the input's
    gradient (the caller sums it, SumGradient)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(submodule.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
                submodule.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))

        distribute_module(module, device_mesh, shard)
        module.forward = lambda x: torch.nn.functional.linear(x, module.weight.to_local())
        return module


class SumGradient(ParallelStyle):
    """The module's input at `index` passes unchanged; its gradient is summed over the ranks."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def summed(_module, inputs):
            value = DTensor.from_local(inputs[self.index], device_mesh, [Replicate()], run_check=False)
            value = value.to_local(grad_placements=[Partial()])
            return (*inputs[: self.index], value, *inputs[self.index + 1 :])

        module.register_forward_pre_hook(summed)
        return module


def attention_plan(args: DeepseekV3Args) -> dict[str, ParallelStyle]:
    query = {"attention.wq_b": ColwiseParallel()} if args.q_lora_rank else {"attention.wq": ColwiseParallel()}
    return {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin): x gathered over the sequence, handed over as a plain tensor whose gradient
        # arrives whole (every head's part summed at the queries' projection and at the latent).
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        **query,
        "attention.wkv_b": HeadColumns(),
        "attention.kernel": SumGradient(index=1),  # (q, latent, expand, mask)
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }  # fmt: skip


def tensor_parallel_plan(args: DeepseekV3Args, loss_parallel: bool) -> TensorParallelPlan:
    dense = {key: style for key, style in block_plan().items() if key.startswith("feed_forward")}
    block = attention_plan(args) | dense | moe_plan("moe", args.moe())
    mtp = {}
    for layer in range(args.n_layers, args.n_layers + args.mtp_depth):
        for norm in ("embedding_norm", "hidden_norm", "projection"):
            mtp[f"layers.{layer}.{norm}"] = SequenceParallel(use_local_output=True)
        mtp[f"layers.{layer}.head_norm"] = SequenceParallel()
    return TensorParallelPlan(root=root_plan(loss_parallel) | mtp, block=block)


def tensor_parallel_sizes(args: DeepseekV3Args) -> dict[str, int]:
    """Sizes the plan splits over tp, which the degree must divide (routed experts are not split)."""
    sizes = {
        "model n_heads": args.n_heads,
        "model ffn_hidden_dim": args.ffn_hidden_dim,
        "the vocabulary size": args.vocab_size,
    }
    if args.shared_hidden_dim:
        sizes["model shared_hidden_dim"] = args.shared_hidden_dim
    return sizes
