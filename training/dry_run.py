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
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the "fake" backend

    world = config.job.dry_run_world_size or distributed.world_size()
    dims = ParallelDims.from_config(config.parallelism, world)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_model(config, dims, mesh, torch.device("cpu"), initialize=False)
    global_batch, accumulation = plan_batches(config.training, dims.dp)
    estimate = memory_estimate.for_config(config, dims, model.parts, model.args, model.spec.tail)
    logger.info(
        f"dry run of {model.spec.name} {config.model.flavor} ({model.num_params:,} parameters): "
        f"{dims.describe()}"
    )
    logger.info(f"mesh {mesh.shape()}")
    logger.info(
        f"global batch {global_batch} = {config.training.local_batch_size} per micro-batch x {dims.dp} "
        f"data-parallel x {accumulation} accumulation"
    )
    stages = f" (pipeline stages {model.stage_indices} of {model.num_stages})" if dims.pp_enabled else ""
    logger.info(f"parameters on rank 0: {estimate.parameters:,}{stages}")
    logger.info(
        f"estimated memory per rank: {estimate.total_gib:.1f} GiB = weights {estimate.weights_gib:.1f} + "
        f"gradients {estimate.gradients_gib:.1f} + AdamW {estimate.optimizer_gib:.1f} + gathered "
        f"{estimate.gathered_gib:.1f} + activations ~{estimate.activations_gib:.1f}"
    )
    dist.destroy_process_group()
    return estimate
