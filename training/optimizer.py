"""AdamW and the learning-rate schedule (linear warmup, then flat, then linear/sqrt/cosine decay).

The schedule is a pure function of the step, so resuming needs no scheduler state beyond the step,
and a run resumed with more steps or another decay follows the new schedule from there.
"""

import math

import torch
from torch import nn

from configs.schema import LRScheduler, Optimizer
from training import bf16_weights
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


def adamw_onto_bf16_copy(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    copy: torch.Tensor,
    step: torch.Tensor,
    lr: torch.Tensor,
    divisor: torch.Tensor,
    skip: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW on a float32 weight from the bf16 gradient of its bf16 copy, which it then rewrites
    (training/bf16_weights.py): torch's fused AdamW arithmetic, the gradient divided by `divisor`;
    where `skip` is 1 nothing changes, the step count included. Compiled, one pass over the tensors."""
    keep = skip > 0
    step.add_(1 - skip)
    grad = grad.float() / divisor
    new_avg = beta1 * exp_avg + (1 - beta1) * grad
    new_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denominator = new_avg_sq.sqrt() / (1 - beta2**step).sqrt() + eps
    new_weight = weight * (1 - lr * weight_decay) - lr / (1 - beta1**step) * new_avg / denominator
    exp_avg.copy_(torch.where(keep, exp_avg, new_avg))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, new_avg_sq))
    weight.copy_(torch.where(keep, weight, new_weight))
    copy.copy_(weight)


# One compiled graph for every size (the tensors are passed flattened), so one compilation per run.
_compiled_adamw_onto_bf16_copy = torch.compile(adamw_onto_bf16_copy, dynamic=True, fullgraph=True)


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
        # Weights whose layers compute with bf16 copies (training/bf16_weights.py): their gradients
        # are on the copies; the update below reads them there and rewrites the copies.
        self.bf16_copies = {w: c for part in model_parts for w, c in bf16_weights.copies(part).items()}

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
        flag on the host: free on the CPU, one synchronization on CUDA. Weights with bf16 copies
        have no gradient of their own (every implementation passes over them) and are updated
        last, with both taken on the device.
        """
        for optimizer in self.parts:
            if optimizer.defaults.get("fused"):
                optimizer.found_inf, optimizer.grad_scale = skip, clip  # (None: not used)
                optimizer.step()
                del optimizer.found_inf, optimizer.grad_scale
            else:
                if clip is not None:
                    scale_grads_([p for group in optimizer.param_groups for p in group["params"]], clip)
                if skip is None or not skip.item():
                    optimizer.step()
            if self.bf16_copies:
                self._update_bf16_copied(optimizer, skip, clip)

    @torch.no_grad()
    def _update_bf16_copied(self, optimizer, skip, clip) -> None:
        for group in optimizer.param_groups:
            copied = [
                w for w in group["params"] if w in self.bf16_copies and self.bf16_copies[w].grad is not None
            ]
            if not copied:
                continue
            device = copied[0].device
            lr = torch.full((), group["lr"], device=device)  # a tensor: no recompilation as it changes
            divisor = torch.ones((), device=device) if clip is None else clip
            skip_flag = torch.zeros((), device=device) if skip is None else skip
            update = _compiled_adamw_onto_bf16_copy if device.type == "cuda" else adamw_onto_bf16_copy
            for weight in copied:
                copy, state = self.bf16_copies[weight], optimizer.state[weight]
                if not state:  # as torch's AdamW starts a weight's state (a fused one's step count)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
                state["step"] = state["step"].to(device)  # on the CPU after loading a non-fused state
                update(
                    weight.view(-1), copy.grad.view(-1), state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1), copy.view(-1), state["step"], lr, divisor, skip_flag,
                    group["betas"][0], group["betas"][1], group["eps"], group["weight_decay"],
                )  # fmt: skip

    def zero_grad(self) -> None:
        for optimizer in self.parts:
            optimizer.zero_grad(set_to_none=True)
        for copy in self.bf16_copies.values():
            copy.grad = None
