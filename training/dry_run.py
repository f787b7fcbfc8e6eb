"""--job.dry_run: check a config for a target world size and show its layout, without training.

Runs in one process with a fake process group standing for rank 0 of the target world
(job.dry_run_world_size), builds the model on the meta device and applies every parallelism to
it, so the same checks run as in a real launch; then prints the mesh, this rank's parameters and
the estimated memory per rank (training/memory_estimate.py).
"""

import logging

import torch.distributed as dist

from configs.schema import JobConfig
from data.loader import plan_batches
from parallelisms import ParallelDims, parallelize
from parallelisms.pipeline import split_model
from training import distributed, memory_estimate
from training.model_setup import resolve_model

logger = logging.getLogger("train")


def dry_run(config: JobConfig) -> memory_estimate.MemoryEstimate:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    world = config.job.dry_run_world_size or distributed.world_size()
    dims = ParallelDims.from_config(config.parallelism, world)
    dist.init_process_group("fake", store=torch.testing._internal.distributed.fake_pg.FakeStore(), rank=0,
                            world_size=world)  # fmt: skip
    mesh = dims.build_mesh("cpu")
    spec, _, args = resolve_model(config, dims)
    global_batch, accumulation = plan_batches(config.training, dims.dp)
    with torch.device("meta"):
        model = spec.model_cls(args)
    total = sum(p.numel() for p in model.parameters())
    parts = [model]
    if dims.pp_enabled:
        parts, indices, num_stages = split_model(
            model, spec.pipeline_split(args), config.parallelism, mesh["pp"]
        )
    for part in parts:
        parallelize(part, spec, dims, mesh, config, torch.device("cpu"))
    tokens = config.training.local_batch_size * config.training.seq_len // dims.cp
    in_flight = dims.pp if dims.pp_enabled else 1
    estimate = memory_estimate.estimate(parts, args, tokens, dims.tp, dims.fsdp_enabled,
                                        config.activation_checkpoint.mode, in_flight)  # fmt: skip
    logger.info(f"dry run of {spec.name} {config.model.flavor} ({total:,} parameters): {dims.describe()}")
    logger.info(f"mesh {mesh.shape()}")
    logger.info(
        f"global batch {global_batch} = {config.training.local_batch_size} per micro-batch x {dims.dp} "
        f"data-parallel x {accumulation} accumulation"
    )
    stages = f" (pipeline stages {indices} of {num_stages})" if dims.pp_enabled else ""
    logger.info(f"parameters on rank 0: {estimate.parameters:,}{stages}")
    logger.info(
        f"estimated memory per rank: {estimate.total_gib:.1f} GiB = weights {estimate.weights_gib:.1f} + "
        f"gradients {estimate.gradients_gib:.1f} + AdamW {estimate.optimizer_gib:.1f} + gathered "
        f"{estimate.gathered_gib:.1f} + activations ~{estimate.activations_gib:.1f}"
    )
    dist.destroy_process_group()
    return estimate
