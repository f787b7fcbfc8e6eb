"""Tensor parallelism: apply a model's plan (models/<family>/parallelize.py), keep tied weights
tied, and loss parallelism."""

import contextlib
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from configs import UserError
from configs.schema import JobConfig
from models.spec import TensorParallelPlan
from parallelisms.tied_weights import retie, tied_parameter_names


def apply_tensor_parallel(
    model: nn.Module, plan: TensorParallelPlan, head: tuple[str, ...], tp_mesh: DeviceMesh
) -> None:
    """Apply the plan to the modules this model (or pipeline stage) holds; the head modules' outputs
    enter the first block and are handed over as tensors of their own (FreshLocalOutput)."""
    groups = tied_parameter_names(model)
    root = {
        name: FreshLocalOutput(style) if name in head else style
        for name, style in plan.root.items()
        if _holds(model, name)
    }
    parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():  # (a plan may cover several kinds of block: dense, MoE)
        parallelize_module(
            block, tp_mesh, {name: style for name, style in plan.block.items() if _holds(block, name)}
        )
    retie(model, groups)  # the plan replaces parameters module by module, which unties them


def check_async_tensor_parallel(config: JobConfig, tp_enabled: bool, device: torch.device) -> None:
    if not config.parallelism.enable_async_tensor_parallel:
        return
    option = "parallelism.enable_async_tensor_parallel"
    if not tp_enabled:
        raise UserError(f"{option} needs tensor_parallel_degree > 1")
    if not config.compile.enable:
        raise UserError(f"{option} needs compile.enable: the compiled blocks' collectives are what overlaps")
    if device.type != "cuda" and not config.job.dry_run:  # a dry run checks a GPU job on any machine
        raise UserError(f"{option} needs CUDA GPUs (symmetric memory); this run is on {device.type}")


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """torch's micro-pipelined TP, a pass of inductor over every graph compiled from here on."""
    torch._inductor.config._micro_pipeline_tp = True
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():  # needed by older torch; later ones deprecate it as a no-op
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def _holds(model: nn.Module, name: str) -> bool:
    """False for a module a pipeline stage dropped (set to None)."""
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


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
