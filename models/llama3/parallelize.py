"""How Llama 3 is split by tensor parallelism: the standard decoder plan (Megatron-style with
sequence parallelism, see parallelisms/tensor_parallel.py), which fits this model as it is."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from parallelisms.tensor_parallel import decoder_block_plan, decoder_root_plan


def apply_tensor_parallel_plan(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    parallelize_module(model, tp_mesh, decoder_root_plan(loss_parallel))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, decoder_block_plan())
