"""The model a config names: checked against the layout, built on the meta device, split into
pipeline stages and parallelized, then (for training) materialized and initialized, and on one GPU
in bf16 given bf16 copies of its weights to compute with (training/bf16_weights.py).

train.py and the dry run (training/dry_run.py) both build through here, so a config that one
accepts the other accepts too, and both see the same sharded model.
"""

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from configs import UserError
from configs.schema import JobConfig
from data.tokenizer import Tokenizer, build_tokenizer
from models import check_flavor, get_model_spec
from models.spec import ModelSpec, model_args
from parallelisms import ParallelDims, parallelize
from parallelisms.context_parallel import local_positions
from parallelisms.expert_parallel import check_expert_parallel
from parallelisms.parallel_dims import Meshes
from parallelisms.pipeline import check_schedule, split_model
from training import bf16_weights, memory_estimate
from training.weight_init import init_weights, materialize


@dataclass
class BuiltModel:
    spec: ModelSpec
    tokenizer: Tokenizer
    args: Any
    parts: list[nn.Module]
    """What this rank runs: the model, or its pipeline stages (full-model parameter names)."""
    stage_indices: list[int]
    num_stages: int
    num_params: int
    """Of the whole (unsplit, unsharded) model."""
    flops_per_token: float
    compute_dtype: torch.dtype
    """Dtype of the matmuls: bfloat16 on CUDA unless training.mixed_precision_param says float32;
    float32 on CPU, where bf16 matmuls are far slower. Master weights are float32 either way."""


def compute_dtype(config: JobConfig, device: torch.device) -> torch.dtype:
    bf16 = device.type == "cuda" and config.training.mixed_precision_param == "bfloat16"
    return torch.bfloat16 if bf16 else torch.float32


def resolve_model(config: JobConfig, dims: ParallelDims) -> tuple[ModelSpec, Tokenizer, Any]:
    """The model's spec, the tokenizer and the model args, after the checks that need no model:
    flavor, sequence split (CP, TP), sizes that TP must divide, the pipeline schedule."""
    spec = get_model_spec(config.model.name)
    check_flavor(spec, config.model.flavor)
    tokenizer = build_tokenizer(config.model.hf_assets_path)
    args = model_args(
        spec, config.model.flavor, config.training.seq_len, tokenizer.vocab_size, config.model.args
    )
    dims.check_sequence_split(config.training.seq_len)
    if dims.tp_enabled:
        if spec.tensor_parallel_plan is None:
            raise UserError(f"model {spec.name} has no tensor-parallel plan (ModelSpec.tensor_parallel_plan)")
        dims.check_divisibility(spec.tensor_parallel_sizes(args))
    if dims.pp_enabled:
        check_schedule(config.parallelism, dims.fsdp_enabled)
    return spec, tokenizer, args


def build_model(
    config: JobConfig, dims: ParallelDims, mesh: Meshes, device: torch.device, initialize: bool = True
) -> BuiltModel:
    """initialize=False (dry run) leaves the parallelized parts on the meta device; before initializing,
    a run whose estimated memory per rank exceeds the device is refused (training/memory_estimate.py)."""
    spec, tokenizer, args = resolve_model(config, dims)
    with torch.device("meta"):
        model = spec.model_cls(args)
    num_params = sum(p.numel() for p in model.parameters())
    if dims.ep_enabled:
        check_expert_parallel(model)
    flops_per_token = model.flops_per_token(config.training.seq_len)
    # Pipeline parallelism first cuts the model into this rank's stages (keeping parameter names);
    # every part then goes through the same chain of parallelisms.
    parts, stage_indices, num_stages = [model], [0], 1
    if dims.pp_enabled:
        parts, stage_indices, num_stages = split_model(
            model, spec.head, spec.tail, config.parallelism, mesh["pp"], spec.last_stage(args)
        )
    dtype = compute_dtype(config, device)
    for part in parts:
        parallelize(part, spec, args, dims, mesh, config, device, dtype)
    if initialize:
        estimate = memory_estimate.for_config(config, dims, parts, args, spec.tail, stage_indices)
        memory_estimate.check_fits(estimate, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        with torch.device("meta"):
            template = spec.model_cls(args)  # unsharded reference for layout-independent init
        # A context-parallel rank holds some chunks of every sequence: these token positions.
        positions = None
        if dims.cp_enabled:
            positions = local_positions(config.training.seq_len, mesh["cp"].get_local_rank(), dims.cp)
        for part in parts:
            materialize(part, device)
            init_weights(part, template, config.job.seed)
            part.init_buffers(positions)
            part.train()
    # One GPU in bf16: linear layers compute with bf16 copies of their weights (under FSDP its mixed
    # precision makes bf16 copies; pipeline schedules compute weight gradients themselves).
    copies = dtype == torch.bfloat16 and config.training.bf16_weight_copies
    if initialize and copies and not (dims.fsdp_enabled or dims.pp_enabled):
        for part in parts:
            bf16_weights.convert(part)
    return BuiltModel(
        spec, tokenizer, args, parts, stage_indices, num_stages, num_params, flops_per_token, dtype
    )
