"""Activation checkpointing per transformer block: full, every N-th block, or selective by op."""

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from configs import UserError
from configs.schema import ActivationCheckpoint

# Kept in "op" mode: the outputs of the expensive ops. Everything else (norms, RoPE, SiLU,
# residual adds) is recomputed in backward from these.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_mm.default,
}


def _op_policy():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def check_activation_checkpointing(config: ActivationCheckpoint, cp_enabled: bool, ep_enabled: bool) -> None:
    """Checkpointing by op replays a block's ops by count in backward; the collectives inside a block
    under context parallelism (the K/V all-gather and its causal mask) or expert parallelism (the
    all-to-all hooks and their host reads) break that replay in torch 2.13 ("Creating a new Tensor
    subclass CausalBias ...", "invocation ... not found in storage"). Full checkpointing and every
    N-th block work with both."""
    if config.mode == "selective" and config.selective_ac_option == "op" and (cp_enabled or ep_enabled):
        what = "context" if cp_enabled else "expert"
        raise UserError(
            f"{what} parallelism with activation_checkpoint selective_ac_option = 'op' fails in torch's "
            "selective checkpointing; use mode = 'full' or selective_ac_option = N (every N-th block)"
        )


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpoint) -> None:
    """Wrap the blocks of model.layers in place (parameter names gain `_checkpoint_wrapped_module`,
    which checkpoints and init strip)."""
    if config.mode == "none":
        return
    by_op = config.mode == "selective" and config.selective_ac_option == "op"
    every = int(config.selective_ac_option) if config.mode == "selective" and not by_op else 1
    for index, (name, block) in enumerate(list(model.layers.named_children()), 1):
        if index % every:
            continue  # selective every-N: the other blocks keep their activations
        options = {"context_fn": _op_policy} if by_op else {}
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **options))
