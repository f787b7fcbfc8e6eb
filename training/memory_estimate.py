"""Per-rank memory of a training step, estimated from the parallelized (meta-device) model.

Exact, from the rank's own parameter shards: fp32 weights, fp32 gradients, the optimizer's state
(AdamW's two moments, Muon's one momentum buffer, in optimizer.state_dtype), and FSDP's gathered
bf16 copies of up to two blocks at a time (prefetch). A parameter's gathered copy is its local shard
times the ranks FSDP shards it over (rank 0's shard is the largest, so this is FSDP's padded size):
the rank's tensor-parallel slice, or the whole tensor where TP replicates it (norms, an MoE layer's
router and routed experts). FSDP shards a block over dp_shard x cp ranks; under expert parallelism
an MoE layer's routed experts are sharded apart, over the dp_shard x cp / ep ranks that EP leaves,
so a rank gathers only its own n_experts / ep experts.

Estimated, the activations kept for backward, per token of a micro-batch on this rank:

    dense layer  ACTIVATION_BYTES_PER_FFN x ffn_hidden_dim / tp
    MoE layer    ACTIVATION_BYTES_PER_FFN x (top_k x expert_hidden_dim + shared_hidden_dim / tp)
    logits       6 bytes x vocab / tp  (bf16 logits and their fp32-sized gradient work), once more for
                 each multi-token-prediction depth

The coefficient was measured on an H200 for compiled bf16 Llama 3 without activation checkpointing
(1B and 3B at seq 8192 give ~54 KB per token and layer with ffn 8192; docs/performance.md holds the
estimates against the measured peaks); it stands for the whole block, attention included, scaled by
the feed-forward width a token goes through. For an MoE layer that width is its top_k routed experts
plus the shared experts: the dense fit carried over, not fitted to MoE layers (Qwen3-30B-A3B cut to
4 layers: 54.6 GiB estimated, 51.6 GiB measured peak in docs/moe.md; `python
scripts/estimate_memory.py --world-size 1 -- --config configs/qwen3_moe_30b_a3b.toml --model.args
n_layers=4`). TP does not split the routed experts (each TP rank runs them on the whole sequence,
models/moe_plans.py), so that part is not divided by tp;
EP sends routed tokens to other ranks, but on balanced routing a rank receives as many as it
sends, so nothing depends on ep. Full activation checkpointing keeps only each block's input plus
one block's activations. Check the estimate against a measured peak before relying on it.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from configs import UserError
from configs.schema import Optimizer
from models.moe import moe_layers
from models.spec import multi_token_prediction
from parallelisms.wrapper_names import original_name
from training.optimizer import parameter_roles

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


def gathered_numel(block: nn.Module, fsdp_ranks: int, ep: int) -> int:
    """Elements FSDP all-gathers for one block on this rank: each parameter's local shard times the
    ranks FSDP shards it over (fsdp_ranks; fsdp_ranks / ep for routed experts, see the docstring)."""
    experts = {id(p) for moe in moe_layers(block).values() for p in moe.experts.parameters()}
    return sum(local_numel(p) * (fsdp_ranks // ep if id(p) in experts else fsdp_ranks)
               for p in block.parameters())  # fmt: skip


def block_activation_bytes(block: nn.Module, args, tp: int) -> float:
    """Bytes per token a block keeps for backward (no checkpointing), see the module docstring."""
    moe = next(iter(moe_layers(block).values()), None)
    if moe is None:
        if not hasattr(args, "ffn_hidden_dim"):
            raise UserError(
                f"{type(args).__name__} has no ffn_hidden_dim, the feed-forward width of its blocks "
                "without experts, which the memory estimate reads (models/spec.py, ARGS_READ_OUTSIDE_MODELS)"
            )
        return ACTIVATION_BYTES_PER_FFN * args.ffn_hidden_dim / tp
    width = moe.args.top_k * moe.args.expert_hidden_dim + moe.args.shared_hidden_dim / tp
    return ACTIVATION_BYTES_PER_FFN * width


def estimate(
    model_parts: list[nn.Module],
    args,
    tokens_per_micro_batch: int,
    tp: int,
    fsdp_ranks: int,
    ac_mode: str,
    in_flight_micro_batches: int = 1,
    ep: int = 1,
    *,
    tail: tuple[str, ...],
    optimizer: Optimizer | None = None,
) -> MemoryEstimate:
    """tokens_per_micro_batch: this rank's (local batch x local sequence length); fsdp_ranks: the
    ranks FSDP shards each block over (dp_shard x cp), 0 without FSDP; ep: the expert-parallel
    degree; with pipeline parallelism 1F1B keeps up to pp micro-batches in flight
    (in_flight_micro_batches); tail: the modules after the blocks (ModelSpec.tail), whose holder
    keeps the logits; optimizer: its config (None: AdamW with float32 moments)."""
    local = sum(local_numel(p) for part in model_parts for p in part.parameters())
    optimizer = optimizer or Optimizer()
    state_bytes = torch.empty((), dtype=getattr(torch, optimizer.state_dtype)).element_size()
    states = 0
    for part in model_parts:  # Muon keeps one state tensor per parameter, AdamW two
        roles = parameter_roles(part, optimizer)
        states += sum((1 if roles[original_name(n)] == "muon" else 2) * local_numel(p)
                      for n, p in part.named_parameters() if p.requires_grad)  # fmt: skip
    blocks = [block for part in model_parts for block in part.layers.values()]
    block_gathered = max((gathered_numel(block, fsdp_ranks, ep) for block in blocks), default=0)
    per_layer = [block_activation_bytes(block, args, tp) for block in blocks]
    if ac_mode == "full":  # block inputs, and one block recomputed
        per_token = len(blocks) * 2 * args.dim + max(per_layer, default=0)
    else:
        per_token = sum(per_layer)
    holds_tail = any(getattr(part, name, None) is not None for part in model_parts for name in tail)
    heads = 1 + multi_token_prediction(args)[0]  # the main logits, and each MTP depth's
    per_token += heads * 6 * args.vocab_size / tp if holds_tail else 0
    activations = per_token * tokens_per_micro_batch * in_flight_micro_batches
    return MemoryEstimate(
        parameters=local,
        weights_gib=4 * local / GIB,
        gradients_gib=4 * local / GIB,
        optimizer_gib=state_bytes * states / GIB,
        gathered_gib=2 * 2 * block_gathered / GIB,
        activations_gib=activations / GIB,
    )


def for_config(
    config, dims, model_parts: list[nn.Module], args, tail: tuple[str, ...], stage_indices: list[int] = (0,)
) -> MemoryEstimate:
    """The estimate for this rank of a run: its parts, its micro-batch, its layout; tail: the
    family's ModelSpec.tail; stage_indices: the pipeline stages the parts are (1F1B keeps pp - s
    micro-batches in flight on stage s; other schedules are counted at pp, the most)."""
    tokens = config.training.local_batch_size * config.training.seq_len // dims.cp
    in_flight = 1
    if dims.pp_enabled:
        one_f_one_b = config.parallelism.pipeline_parallel_schedule == "1F1B"
        in_flight = dims.pp - min(stage_indices) if one_f_one_b else dims.pp
    fsdp_ranks = dims.dp_shard * dims.cp if dims.fsdp_enabled else 0
    return estimate(model_parts, args, tokens, dims.tp, fsdp_ranks,
                    config.activation_checkpoint.mode, in_flight, dims.ep, tail=tail,
                    optimizer=config.optimizer)  # fmt: skip


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
