"""The optimizer (AdamW, or Muon with AdamW: training/muon.py) and the learning-rate schedule (linear
warmup, then flat, then linear/sqrt/cosine decay).

The schedule is a pure function of the step, so resuming needs no scheduler state beyond the step,
and a run resumed with more steps or another decay follows the new schedule from there.
"""

import logging
import math
import re
from fnmatch import fnmatch

import torch
from torch import nn

from configs.schema import LRScheduler, Optimizer
from parallelisms.wrapper_names import original_name
from training import bf16_weights
from training.adamw import AdamW
from training.grad_clip import group_by_mesh, scale_grads_
from training.muon import Muon
from training.qk_clip import QKClip

logger = logging.getLogger(__name__)


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


def parameter_roles(part: nn.Module, config: Optimizer) -> dict[str, str]:
    """The role, "muon" or "adamw", of each trainable parameter of part, by its plain-model name.
    AdamW: everything, unless optimizer.name is Muon; then Muon takes the 2-D and larger parameters
    of the blocks (names "layers.<i>....": attention and MLP projections, stacked experts) and
    those matching optimizer.muon_params, except biases and those matching optimizer.adamw_params.
    A bias is a vector per output whatever its shape (stacked experts' biases are 2-D: experts x
    out), nothing to orthogonalize, so every name ending in "bias" takes AdamW."""
    roles = {}
    for name, param in part.named_parameters():
        if not param.requires_grad:
            continue
        name = original_name(name)
        in_block = name.startswith("layers.") and param.ndim >= 2
        chosen = in_block or (param.ndim >= 2 and any(fnmatch(name, p) for p in config.muon_params))
        kept_from_muon = name.endswith("bias") or any(fnmatch(name, p) for p in config.adamw_params)
        muon = config.name == "Muon" and chosen and not kept_from_muon
        roles[name] = "muon" if muon else "adamw"
    return roles


def describe_roles(roles: dict[str, str]) -> str:
    """Which parameters get which, block indices folded: "Muon: layers.*.attention.wq.weight, ..."."""
    folded = {"muon": {}, "adamw": {}}
    for name, role in roles.items():
        folded[role][re.sub(r"^layers\.\d+\.", "layers.*.", name)] = None
    return "; ".join(
        f"{label}: {', '.join(folded[role]) or '-'}" for role, label in (("muon", "Muon"), ("adamw", "AdamW"))
    )


def build_optimizer(part: nn.Module, config: Optimizer, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of one model part: torch's AdamW, ours with bf16 moments, or Muon."""
    roles = parameter_roles(part, config)
    named = [(original_name(n), p) for n, p in part.named_parameters() if p.requires_grad]
    in_out = {
        id(p)
        for m in part.modules()
        if getattr(m, "matrices_in_out", False)
        for p in m.parameters(recurse=False)
    }
    adamw = [p for n, p in named if roles[n] == "adamw"]
    # Weight decay on matrices only; norm weights (1-D) are left alone.
    adamw_groups = [
        {"params": selected, "weight_decay": decay}
        for decay, selected in ((config.weight_decay, [p for p in adamw if p.ndim >= 2]),
                                (0.0, [p for p in adamw if p.ndim < 2]))
    ]  # fmt: skip
    state_dtype = getattr(torch, config.state_dtype)
    if config.name == "Muon":
        muon = [p for n, p in named if roles[n] == "muon"]
        muon_groups = [
            {"params": [p for p in muon if (id(p) in in_out) == transposed], "algorithm": "muon",
             "lr": config.muon_lr or config.lr, "momentum": config.muon_momentum,
             "nesterov": config.muon_nesterov, "weight_decay": config.muon_weight_decay,
             "adjust_lr": config.muon_adjust_lr, "matrices_in_out": transposed}
            for transposed in (False, True)
        ]  # fmt: skip
        for group in adamw_groups:
            group.update(algorithm="adamw", lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
        ns_dtype = config.muon_ns_dtype
        if ns_dtype == "auto":
            ns_dtype = "bfloat16" if device.type == "cuda" else "float32"
        groups = [g for g in muon_groups + adamw_groups if g["params"]]
        return Muon(
            groups,
            config.muon_ns_steps,
            tuple(config.muon_ns_coefficients),
            getattr(torch, ns_dtype),
            state_dtype,
        )
    if state_dtype != torch.float32:
        groups = [g for g in adamw_groups if g["params"]]
        return AdamW(
            groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, state_dtype=state_dtype
        )
    # torch's AdamW: one group per device mesh, as its foreach and fused kernels take tensors of
    # one mesh (expert parallelism adds a second).
    groups = [
        {"params": same_mesh, "weight_decay": group["weight_decay"]}
        for group in adamw_groups
        for same_mesh in group_by_mesh(group["params"]).values()
        if same_mesh
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


class Optimizers:
    """The optimizer of each model part (a rank holds several parts with virtual pipeline stages),
    stepped together. One per part because checkpoints save optimizer state under each part's
    parameter names (torch.distributed.checkpoint.state_dict works per module).

    The configured optimizer performs every update. Weights whose layers compute with bf16 copies
    (training/bf16_weights.py) have their gradients on the copies: the step moves them onto the
    float32 weights first and refreshes the copies from the updated weights after."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        config: Optimizer,
        schedule: LRScheduler,
        steps: int,
        device: torch.device,
        qk_clip: QKClip | None = None,
    ):
        self.parts = [build_optimizer(part, config, device) for part in model_parts]
        self.qk_clip = qk_clip  # MuonClip: clips attention heads after each update
        self.peak_lr, self.schedule, self.steps = config.lr, schedule, steps
        self.peak_lrs = [[group["lr"] for group in optimizer.param_groups] for optimizer in self.parts]
        self.bf16_copies = {w: c for part in model_parts for w, c in bf16_weights.copies(part).items()}
        if config.name == "Muon":
            roles = {n: r for part in model_parts for n, r in parameter_roles(part, config).items()}
            logger.info(f"optimizer Muon ({describe_roles(roles)})")

    def set_lr(self, step: int) -> float:
        """Set every group's lr for optimizer step `step` (1-based); returns optimizer.lr's value."""
        factor = lr_factor(step - 1, self.steps, self.schedule)
        for optimizer, peaks in zip(self.parts, self.peak_lrs):
            for group, peak in zip(optimizer.param_groups, peaks):
                group["lr"] = peak * factor
        return self.peak_lr * factor

    def step(self, skip: torch.Tensor | None = None, clip: torch.Tensor | None = None) -> None:
        """One update of every part. skip: a device flag (0. or 1.) that cancels the update; clip:
        what to divide the gradients by (training/grad_clip.py's clip_divisor), or None.

        torch's fused AdamW takes both on the device, through the hooks torch's gradient scaler
        uses: `found_inf` (moments, step counts and weights stay untouched) and `grad_scale` (the
        kernel divides each gradient as it reads it: no separate pass over the gradients), with no
        synchronization. The other optimizers get the gradients divided first and read the flag on
        the host: free on the CPU, one synchronization on CUDA.
        """
        self._gradients_from_copies()
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
        if self.qk_clip is not None:
            self.qk_clip.after_step(skip)
        self._refresh_copies()

    @torch.no_grad()
    def _gradients_from_copies(self) -> None:
        for weight, copy in self.bf16_copies.items():
            if copy.grad is not None:
                weight.grad, copy.grad = copy.grad.to(weight.dtype), None

    @torch.no_grad()
    def _refresh_copies(self) -> None:
        for weight, copy in self.bf16_copies.items():
            copy.copy_(weight)

    def zero_grad(self) -> None:
        for optimizer in self.parts:
            optimizer.zero_grad(set_to_none=True)
        for copy in self.bf16_copies.values():
            copy.grad = None
