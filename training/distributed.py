"""Process set-up: device choice, the process group under torchrun, logging, collectives on scalars."""

import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from configs import UserError


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_logging() -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors (prefixed with their rank)."""
    # DTensor warns once per process when a norm over expert parallelism's 2-D mesh takes two
    # scalar all-reduces instead of one: nothing to act on at that size.
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda record: "sequential all_reduce" not in record.getMessage()
    )
    prefix = f"[rank{rank()}] " if world_size() > 1 and rank() != 0 else ""
    logging.basicConfig(
        level=logging.INFO if rank() == 0 else logging.WARNING,
        format=f"%(asctime)s {prefix}%(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


def select_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("training.device = 'cuda' but no CUDA device is available")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    # Growable allocator segments: far less memory lost to fragmentation between steps of different
    # allocation patterns (accumulation, pipeline micro-batches). Page-locked host memory (the
    # checkpoint's host buffers) allocated as ordinary memory touched in 8 threads, then registered
    # with CUDA: 6.6 GB/s against cudaHostAlloc's 1.6 on the H200 machine (docs/checkpointing.md).
    # Read when CUDA starts, so set it first; a user's own setting wins.
    os.environ.setdefault(
        "PYTORCH_CUDA_ALLOC_CONF",
        "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    )
    device = torch.device("cuda", local_rank())
    torch.cuda.set_device(device)
    return device


def init_process_group(device: torch.device) -> None:
    """Join the torchrun job; a plain `python train.py` forms a group of one, so the code path (and
    the device mesh) is the same for every launch."""
    if dist.is_initialized():
        return
    # gloo serves CPU tensors (also on GPU machines, for small host-side reductions).
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def all_reduce_sum(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value


def gather_sample_ids(micro_batches: list[dict], dp_group: dist.ProcessGroup) -> list[int]:
    """The global ids of the samples that all data-parallel ranks read this step, sorted."""
    local = [int(i) for batch in micro_batches for i in batch["sample_ids"]]
    gathered: list[list[int]] = [[] for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather_object(gathered, local, group=dp_group)
    return sorted(i for ids in gathered for i in ids)


def destroy_process_group(wait_for_peers: bool = False) -> None:
    """wait_for_peers: after a normal finish, so that no rank tears down its connections while a
    peer still has messages in flight (seen to abort gloo at exit); not after an error, where a
    peer may never arrive."""
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
