"""Parallelisms, applied from the [parallelism] section by the one entry below.

parallel_dims.py     degrees, checks and the device mesh
pipeline.py          splitting into stages and running a schedule (train.py calls it first)
float8.py            torchao float8 Linear layers
tensor_parallel.py   applying a model's TP plan, loss parallelism
context_parallel.py  load-balanced sequence split, all-gather-KV attention
expert_parallel.py   MoE experts over ranks, tokens by all-to-all
activation_checkpoint.py  recompute activations in backward (full, every N blocks, by op)
compile.py           torch.compile per block
fsdp.py              FSDP2 / HSDP
"""

from typing import Any

import torch
from torch import nn

from configs.schema import JobConfig
from models.spec import ModelSpec
from parallelisms.activation_checkpoint import apply_activation_checkpointing, check_activation_checkpointing
from parallelisms.compile import apply_compile, check_compile, compile_inside_checkpointing
from parallelisms.context_parallel import apply_context_parallel
from parallelisms.expert_parallel import apply_expert_parallel
from parallelisms.float8 import apply_float8, check_float8
from parallelisms.fsdp import apply_fsdp
from parallelisms.parallel_dims import Meshes, ParallelDims
from parallelisms.tensor_parallel import (
    apply_tensor_parallel,
    check_async_tensor_parallel,
    enable_async_tensor_parallel,
)


def parallelize(
    model: nn.Module,
    spec: ModelSpec,
    args: Any,
    dims: ParallelDims,
    mesh: Meshes,
    config: JobConfig,
    device: torch.device,
    param_dtype: torch.dtype,
) -> None:
    """Apply the parallelisms to a meta-device model, in place, in this order (the order matters):

    (Pipeline splitting comes before: training/model_setup.py calls this once per stage.)
    1. float8: Linear layers become torchao Float8Linear (before any sharding sees them)
    2. tensor + sequence parallel (the model's own plan): parameters become DTensors over "tp";
       the loss is computed on vocabulary shards when loss parallelism is on; async TP asks
       inductor (step 6) to overlap the TP collectives with the matmuls
    3. expert parallel: MoE layers' experts are sharded over "ep", their tokens sent by all-to-all
    4. context parallel: causal attention kernels become all-gather-KV ones over "cp"
    5. activation checkpointing: blocks are wrapped to recompute activations in backward
    6. torch.compile per block: it sees the sharded, wrapped block it will run (with tensor
       parallelism and checkpointing on torch < 2.14 it is compiled before 5 and wrapped by it:
       parallelisms/compile.py says why)
    7. FSDP on every block, then on the root: parameters are sharded over the data-parallel (and
       context-parallel) ranks, 2-D DTensors when tensor parallel came first; experts apart, over
       the ranks expert parallelism leaves
    """
    check_float8(config.float8, device, dims.tp_enabled, dims.fsdp_enabled)
    check_compile(config, dims.tp_enabled)
    check_async_tensor_parallel(config, dims.tp_enabled, device)
    check_activation_checkpointing(config.activation_checkpoint, dims.cp_enabled, dims.ep_enabled)
    if config.float8.enable:
        apply_float8(model, config.float8, device)
    if dims.tp_enabled:
        plan = spec.tensor_parallel_plan(args, config.parallelism.enable_loss_parallel)
        apply_tensor_parallel(model, plan, spec.head, mesh["tp"])
        if config.parallelism.enable_async_tensor_parallel and device.type == "cuda":
            enable_async_tensor_parallel(mesh["tp"])
    if dims.ep_enabled:
        apply_expert_parallel(model, mesh["expert_tp"], mesh["ep"])
    if dims.cp_enabled:
        apply_context_parallel(model, mesh["cp"])
    # Context-parallel attention's collectives and expert parallelism's split sizes (read on the
    # host) break the graph; elsewhere one graph per block.
    fullgraph = not (dims.cp_enabled or dims.ep_enabled)
    compile_first = compile_inside_checkpointing(config, dims.tp_enabled)
    if compile_first:
        apply_compile(model, fullgraph, config.compile.backend)
    apply_activation_checkpointing(model, config.activation_checkpoint)
    if config.compile.enable and not compile_first:
        apply_compile(model, fullgraph, config.compile.backend)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            mesh["fsdp"],
            param_dtype=param_dtype,
            reduce_dtype=getattr(torch, config.training.mixed_precision_reduce),
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
            expert_mesh=mesh["expert_fsdp"] if dims.ep_enabled else None,
        )


__all__ = ["ParallelDims", "parallelize"]
