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
    if torch.version.cuda is None:
        quiet_cpu_build_noise()
    prefix = f"[rank{rank()}] " if world_size() > 1 and rank() != 0 else ""
    logging.basicConfig(
        level=logging.INFO if rank() == 0 else logging.WARNING,
        format=f"%(asctime)s {prefix}%(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


def quiet_cpu_build_noise() -> None:
    """torchao (float8) ships CUDA kernels and Triton ones: on a CPU build of torch, importing it logs
    that each failed to load, and torch that the enums it registers need no registration. torchft
    (fault tolerance) warns at every new quorum that it cannot reset NCCL's flight recorder, which a
    build without NCCL does not have. Nothing there is for a CPU run to act on (float8 is emulated,
    torchft's groups talk over gloo), so those lines are dropped."""
    noise = {
        "torchao": "Failed to load ",
        "torchao.kernel.intmm": "Warning: Detected no triton",
        "torch.utils._pytree": "is an Enum subclass and is now natively supported",
        "torchft.manager": "Unable to reset NCCL flight recorder",
    }
    for name, text in noise.items():
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())


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


def init_process_group(device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the torchrun job; a plain `python train.py` forms a group of one, so the code path (and
    the device mesh) is the same for every launch. timeout_s: how long a collective waits for
    every rank (job.collective_timeout_s)."""
    global _timeout_s
    if dist.is_initialized():
        return
    _timeout_s = timeout_s
    # gloo serves CPU tensors (also on GPU machines, for small host-side reductions).
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


_timeout_s = 600.0  # job.collective_timeout_s, as the process group was made with
# What gloo (and NCCL, where it raises) say when a peer hangs or is gone.
_TIMED_OUT = ("Timed out waiting", "timed out", "Timeout")
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def peer_failure(error: BaseException) -> str | None:
    """The one-line cause of a collective that failed because another rank hung or died (None for
    any other error): the other rank's own output has its cause."""
    text = str(error)
    if any(marker in text for marker in _TIMED_OUT):
        return (
            f"rank {rank()} waited job.collective_timeout_s = {_timeout_s:g} s in a collective: another rank "
            "is hung or gone (its output says why; raise the timeout for steps or loads slower than this)"
        )
    if any(marker in text for marker in _PEER_GONE) or isinstance(error, dist.DistBackendError):
        return (
            f"rank {rank()} lost its connection to another rank, which stopped or crashed "
            "(its output says why)"
        )
    return None


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
