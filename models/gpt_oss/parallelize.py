"""How tensor parallelism splits gpt-oss: attention as the standard decoder plan splits it (heads
column-wise in, rows out, their biases with them), the MoE layer as models/moe_plans.py says (router
and routed experts replicated over TP, their biases too).

The sinks, one per head, are split by heads like the query projection (Shard(0)): each rank's heads
keep their own sink, which no other rank's heads touch, so their gradients need no reduction.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput

from models.decoder_plans import block_plan, root_plan
from models.moe_plans import moe_plan
from models.spec import TensorParallelPlan


class InputsAndSinksByHeads(PrepareModuleInput):
    """PrepareModuleInput of the attention module that also splits its `sinks` (one per head) over
    the ranks by heads, as the head-sharded projections are split."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module.sinks
        # No broadcast: the weights are initialized afterwards, each rank filling its own shard.
        sharded = distribute_tensor(sinks.data, device_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter("sinks", nn.Parameter(sharded, requires_grad=sinks.requires_grad))
        return super()._apply(module, device_mesh)


def tensor_parallel_plan(args, loss_parallel: bool) -> TensorParallelPlan:
    attention = {key: style for key, style in block_plan().items() if not key.startswith("feed_forward")}
    # (x, cos, sin): x gathered over the sequence, as block_plan's; the mask, a keyword, is left alone.
    attention["attention"] = InputsAndSinksByHeads(
        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
    )
    return TensorParallelPlan(root=root_plan(loss_parallel), block=attention | moe_plan("moe", args.moe()))


def tensor_parallel_sizes(args) -> dict[str, int]:
    """Sizes the plan splits over tp, which the degree must divide (routed experts are not split)."""
    return {
        "model n_heads": args.n_heads,
        "model n_kv_heads": args.n_kv_heads,
        "the vocabulary size": args.vocab_size,
    }
