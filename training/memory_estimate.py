"""Per-rank memory of a training step, estimated from the parallelized (meta-device) model.

Exact parts, from the rank's own parameter shards: fp32 weights, fp32 gradients, AdamW's two fp32
moments, and FSDP's gathered bf16 copies of up to two blocks at a time (prefetch). Estimated part,
activations kept for backward, per token of a micro-batch on this rank:

    per layer  ACTIVATION_BYTES_PER_FFN x ffn_hidden_dim / tp
    logits     6 bytes x vocab / tp  (bf16 logits and their fp32-sized gradient work)

The per-layer coefficient was measured on an H200 for compiled bf16 Llama 3 without activation
checkpointing (docs/performance.md: 1B and 3B at seq 8192 give ~54 KB per token and layer with
ffn 8192); full activation checkpointing keeps only each block's input plus one block's
activations. It is an estimate: check against a measured peak before relying on it.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from configs import UserError

ACTIVATION_BYTES_PER_FFN = 6.6
GIB = 2**30


@dataclass
class MemoryEstimate:
    parameters: int  # elements held by this rank
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    gathered_gib: float
    activations_gib: float

    @property
    def total_gib(self) -> float:
        return (
            self.weights_gib
            + self.gradients_gib
            + self.optimizer_gib
            + self.gathered_gib
            + self.activations_gib
        )


def local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def estimate(
    model_parts: list[nn.Module],
    args,
    tokens_per_micro_batch: int,
    tp: int,
    fsdp: bool,
    ac_mode: str,
    in_flight_micro_batches: int = 1,
) -> MemoryEstimate:
    """tokens_per_micro_batch: this rank's (local batch x local sequence length); with pipeline
    parallelism 1F1B keeps up to pp micro-batches in flight (in_flight_micro_batches)."""
    local = sum(local_numel(p) for part in model_parts for p in part.parameters())
    layers = sum(len(part.layers) for part in model_parts)
    block_params = max((sum(p.numel() for p in block.parameters()) for part in model_parts
                        for block in part.layers.values()), default=0)  # fmt: skip
    per_layer = ACTIVATION_BYTES_PER_FFN * args.ffn_hidden_dim / tp
    if ac_mode == "full":
        per_token = layers * 2 * args.dim + per_layer  # block inputs, and one block recomputed
    else:
        per_token = layers * per_layer
    has_output = any(getattr(part, "output", None) is not None for part in model_parts)
    per_token += 6 * args.vocab_size / tp if has_output else 0
    activations = per_token * tokens_per_micro_batch * in_flight_micro_batches
    return MemoryEstimate(
        parameters=local,
        weights_gib=4 * local / GIB,
        gradients_gib=4 * local / GIB,
        optimizer_gib=8 * local / GIB,
        gathered_gib=(2 * 2 * block_params / tp / GIB) if fsdp else 0.0,
        activations_gib=activations / GIB,
    )


def for_config(config, dims, model_parts: list[nn.Module], args) -> MemoryEstimate:
    """The estimate for this rank of a run: its parts, its micro-batch, its layout."""
    tokens = config.training.local_batch_size * config.training.seq_len // dims.cp
    in_flight = dims.pp if dims.pp_enabled else 1
    return estimate(model_parts, args, tokens, dims.tp, dims.fsdp_enabled,
                    config.activation_checkpoint.mode, in_flight)  # fmt: skip


def check_fits(estimate: MemoryEstimate, device: torch.device, local_processes: int) -> None:
    """Refuse, before anything is allocated, a run whose estimate exceeds the device's memory (the
    host's memory shared by its processes on a CPU), instead of failing minutes later."""
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).total_memory / GIB
        where = f"{torch.cuda.get_device_name(device)} ({available:.0f} GiB)"
    else:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / local_processes
        where = f"this host's memory per process ({available:.0f} GiB)"
    if estimate.total_gib > available:
        raise UserError(
            f"the run needs about {estimate.total_gib:,.0f} GiB per rank (activations "
            f"~{estimate.activations_gib:,.0f} GiB), more than {where}: lower training.seq_len or "
            "training.local_batch_size, turn on activation_checkpoint.mode, or spread the model over "
            "more ranks (python train.py ... --job.dry_run shows the estimate)"
        )
