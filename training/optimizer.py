"""AdamW and the learning-rate schedule (linear warmup, then flat, then linear/sqrt/cosine decay)."""

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from configs.schema import LRScheduler, Optimizer


def build_optimizer(
    model_parts: list[nn.Module], config: Optimizer, device: torch.device
) -> torch.optim.Optimizer:
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    # Weight decay on matrices only; norm weights (1-D) are left alone.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
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


def lr_factor(step_index: int, steps: int, config: LRScheduler) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index step_index."""
    warmup = min(config.warmup_steps, steps)
    decay = round((steps - warmup) * config.decay_ratio)
    stable = steps - warmup - decay
    if step_index < warmup:
        return (step_index + 1) / (warmup + 1)
    if step_index < warmup + stable or decay == 0:
        return 1.0
    progress = min((step_index - warmup - stable) / decay, 1.0)  # the scheduler looks one step past the end
    shape = {
        "linear": 1 - progress,
        "sqrt": 1 - math.sqrt(progress),
        "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
    }[config.decay_type]
    return config.min_lr_factor + (1 - config.min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRScheduler, steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step_index: lr_factor(step_index, steps, config))
