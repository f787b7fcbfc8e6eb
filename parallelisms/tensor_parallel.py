"""Tensor parallelism: apply a model's plan, keep tied weights tied, and loss parallelism.

The per-model plan (which layer is column- or row-wise) lives in the model's folder
(models/<name>/parallelize.py); this file holds what every model shares.
"""

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

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
