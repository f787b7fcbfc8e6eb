"""How Qwen3 is split by tensor parallelism: the standard decoder plan plus its QK-norm.

The q/k norms act on each head, and under tensor parallelism a rank holds some of the heads: they
run as sequence-parallel norms over the head dimension (dim 2 of batch, seq, heads, head_dim), so
their weight stays one replicated parameter whose gradient sums over all heads' ranks.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from parallelisms.tensor_parallel import decoder_block_plan, decoder_root_plan


def apply_tensor_parallel_plan(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    parallelize_module(model, tp_mesh, decoder_root_plan(loss_parallel))
    qk_norms = {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, decoder_block_plan() | qk_norms)
