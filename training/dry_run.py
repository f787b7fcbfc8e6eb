"""--job.dry_run: check a config for a target world size and show its layout, without training.

Runs in one process with a fake process group standing for rank 0 of the target world
(job.dry_run_world_size) and builds the model exactly as training does (training/model_setup.py),
on the meta device, so the same checks run as in a real launch; then prints the mesh, this rank's
parameters and the estimated memory per rank (training/memory_estimate.py).
"""

import logging

import torch
import torch.distributed as dist

from configs.schema import JobConfig
from data.loader import plan_batches
from parallelisms import ParallelDims
from training import distributed, memory_estimate
from training.model_setup import build_model

logger = logging.getLogger("train")


def dry_run(config: JobConfig) -> memory_estimate.MemoryEstimate:
    """Check the config for its target world and log the layout and each rank's estimated memory;
    returns the largest estimate: with pipeline parallelism each stage's first rank is built in
    turn (stages hold different blocks: DeepSeek-V3's first are dense, the last holds the MTP
    block and the output head), otherwise rank 0 stands for all."""
    world = config.job.dry_run_world_size or distributed.world_size()
    dims = ParallelDims.from_config(config.parallelism, world)
    ranks = [stage * (world // dims.pp) for stage in range(dims.pp)] if dims.pp_enabled else [0]
    largest = None
    for rank in ranks:
        model, estimate = _build_as(config, dims, rank, world)
        if rank == 0:
            global_batch, accumulation = plan_batches(config.training, dims.dp)
            logger.info(
                f"dry run of {model.spec.name} {config.model.flavor} ({model.num_params:,} parameters): "
                f"{dims.describe()}"
            )
            logger.info(
                f"global batch {global_batch} = {config.training.local_batch_size} per micro-batch x "
                f"{dims.dp} data-parallel x {accumulation} accumulation"
            )
        stages = f" (pipeline stages {model.stage_indices} of {model.num_stages})" if dims.pp_enabled else ""
        logger.info(
            f"rank {rank}{stages}: {estimate.parameters:,} parameters, estimated memory "
            f"{estimate.total_gib:.1f} GiB = weights {estimate.weights_gib:.1f} + gradients "
            f"{estimate.gradients_gib:.1f} + optimizer {estimate.optimizer_gib:.1f} + gathered "
            f"{estimate.gathered_gib:.1f} + activations ~{estimate.activations_gib:.1f}"
        )
        if largest is None or estimate.total_gib > largest.total_gib:
            largest = estimate
    logger.info(f"estimated memory per rank: {largest.total_gib:.1f} GiB at most")
    return largest


def _build_as(config: JobConfig, dims: ParallelDims, rank: int, world: int):
    """The model rank `rank` would build (meta device, a fake process group), and its estimate."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the "fake" backend

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
    try:
        mesh = dims.build_mesh("cpu")
        if rank == 0:
            logger.info(f"mesh {mesh.shape()}")
        model = build_model(config, dims, mesh, torch.device("cpu"), initialize=False)
        estimate = memory_estimate.for_config(
            config, dims, model.parts, model.args, model.spec.tail, model.stage_indices
        )
        return model, estimate
    finally:
        dist.destroy_process_group()
