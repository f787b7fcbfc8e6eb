"""AdamW and the learning-rate schedule (linear warmup, then flat, then linear/sqrt/cosine decay).

The schedule is a pure function of the step, so resuming needs no scheduler state beyond the step,
and a run resumed with more steps or another decay follows the new schedule from there.
"""

import math

import torch
from torch import nn

from configs.schema import LRScheduler, Optimizer
from training.grad_clip import group_by_mesh, scale_grads_


def lr_factor(step_index: int, steps: int, config: LRScheduler) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index step_index."""
    warmup = min(config.warmup_steps, steps)
    decay = round((steps - warmup) * config.decay_ratio)
    stable = steps - warmup - decay
    if step_index < warmup:
        return (step_index + 1) / (warmup + 1)
    if step_index < warmup + stable or decay == 0:
        return 1.0
    progress = min((step_index - warmup - stable) / decay, 1.0)
    shape = {
        "linear": 1 - progress,
        "sqrt": 1 - math.sqrt(progress),
        "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
    }[config.decay_type]
    return config.min_lr_factor + (1 - config.min_lr_factor) * shape


def _adamw(part: nn.Module, config: Optimizer, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in part.parameters() if p.requires_grad]
    # Weight decay on matrices only; norm weights (1-D) are left alone. One group per device mesh:
    # the foreach and fused kernels take tensors of one mesh (expert parallelism adds a second).
    groups = [
        {"params": same_mesh, "weight_decay": decay}
        for decay, selected in ((config.weight_decay, [p for p in params if p.ndim >= 2]),
                                (0.0, [p for p in params if p.ndim < 2]))
        for same_mesh in group_by_mesh(selected).values()
        if same_mesh
    ]  # fmt: skip
    implementation = config.implementation
    if implementation == "auto":
        implementation = "fused" if device.type == "cuda" else "foreach"
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )


class Optimizers:
    """One AdamW per model part (a rank holds several parts with virtual pipeline stages), stepped
    together. One per part because checkpoints save optimizer state under each part's parameter
    names (torch.distributed.checkpoint.state_dict works per module)."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        config: Optimizer,
        schedule: LRScheduler,
        steps: int,
        device: torch.device,
    ):
        self.parts = [_adamw(part, config, device) for part in model_parts]
        self.peak_lr, self.schedule, self.steps = config.lr, schedule, steps

    def set_lr(self, step: int) -> float:
        """Set and return the lr of optimizer step `step` (1-based)."""
        lr = self.peak_lr * lr_factor(step - 1, self.steps, self.schedule)
        for optimizer in self.parts:
            for group in optimizer.param_groups:
                group["lr"] = lr
        return lr

    def step(self, skip: torch.Tensor | None = None, clip: torch.Tensor | None = None) -> None:
        """One update of every part. skip: a device flag (0. or 1.) that cancels the update; clip:
        what to divide the gradients by (training/grad_clip.py's clip_divisor), or None.

        Fused AdamW takes both on the device, through the hooks torch's gradient scaler uses:
        `found_inf` (moments, step counts and weights stay untouched) and `grad_scale` (the kernel
        divides each gradient as it reads it: no separate pass over the gradients), with no
        synchronization. The other implementations get the gradients divided first and read the
        flag on the host: free on the CPU, one synchronization on CUDA.
        """
        for optimizer in self.parts:
            if optimizer.defaults.get("fused"):
                optimizer.found_inf, optimizer.grad_scale = skip, clip  # (None: not used)
                optimizer.step()
                del optimizer.found_inf, optimizer.grad_scale
                continue
            if clip is not None:
                scale_grads_([p for group in optimizer.param_groups for p in group["params"]], clip)
            if skip is None or not skip.item():
                optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.parts:
            optimizer.zero_grad(set_to_none=True)
