"""bf16 copies of the matrix weights of a model on one GPU, refreshed after each optimizer step.

A model that FSDP does not wrap computes in bf16 under autocast, which casts every float32 weight
to bf16 in each forward (and again in backward) and every bf16 weight gradient back to float32:
passes over all the weights, ~3% of a Llama 3 step on the H200 (benchmarks/benchmark.py). Here each
nn.Linear reads a bf16 copy of its weight instead; its gradient stays in bf16, on the copy, through
the backward passes of every micro-batch. The optimizer step (training/optimizer.py) moves it onto
the float32 weight, the configured optimizer (whichever it is) updates the weights, and the copies
are refreshed from them. The float32 weights stay the model's parameters, with the optimizer's
state, so checkpoints, resharding and every other layout see what they saw before.

In numbers: a step's forward and backward are those of autocast (the same bf16 roundings), and so
is the update; the gradients of several micro-batches add up in bf16 on the copies, as on FSDP's
bf16 parameters.

torchao's float8 layers (Float8Linear) get copies too: they cast the bf16 copy to float8 instead
of the float32 weight (half the bytes read), their weight gradient stays in bf16 until the step,
as they compute under FSDP's bf16 parameters; +2.4% on the 3B float8 batch-2 step, at 5.3 GiB more
peak memory (docs/performance.md; measured when the update rewrote the copies itself).

Left to autocast: FSDP-wrapped models (FSDP's mixed precision makes bf16 copies itself), pipeline
stages (zero-bubble schedules take the weight gradients of the stage's parameters themselves),
tensor-parallel (DTensor) weights, torchao's float8 all-gather weights and a weight shared by
several modules (tied embeddings). training/model_setup.py decides.
"""

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.tied_weights import tied_parameter_names


class LinearOnBF16Copy(nn.Linear):
    """An nn.Linear whose forward reads `bf16_weight`, a bf16 copy of its float32 `weight`. Made
    by `convert`, which swaps the class of an existing nn.Linear: its parameters, their names and
    the state dict stay as they were (the copy is a buffer outside the state dict)."""

    bf16_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.bf16_weight, self.bias)


@functools.cache
def _float8_linear_on_bf16_copy(float8_linear: type) -> type:
    """A subclass of torchao's Float8Linear whose forward reads `bf16_weight`: Float8Linear.forward
    (torchao 0.18) with the copy in place of the weight. Made on first use: torchao is optional."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    class Float8LinearOnBF16Copy(float8_linear):
        bf16_weight: torch.Tensor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled("cuda"):
                x = x.to(torch.get_autocast_dtype("cuda"))
            output = matmul_with_hp_or_float8_args.apply(
                x, self.bf16_weight.t(), self.linear_mm_config, self.config
            )
            return output if self.bias is None else output + self.bias.to(output.dtype)

    return Float8LinearOnBF16Copy


def _class_on_copy(module: nn.Module) -> type | None:
    """The class module becomes to compute on a bf16 copy; None for layers that keep their own."""
    if type(module) is nn.Linear:
        return LinearOnBF16Copy
    # torchao's Float8Linear, present only where parallelisms/float8.py has loaded torchao's float8
    float8_linear = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    if float8_linear is not None and type(module) is float8_linear:
        return _float8_linear_on_bf16_copy(float8_linear)
    return None  # other subclasses have their own forward


def convert(part: nn.Module) -> int:
    """Give every eligible linear layer of part (nn.Linear, torchao's Float8Linear) a bf16 copy of
    its weight to compute with (see the module docstring for which are not); returns how many were
    converted."""
    tied = {id(part.get_parameter(names[0])) for names in tied_parameter_names(part)}
    converted = 0
    for module in part.modules():
        new_class = _class_on_copy(module)
        if new_class is None:
            continue
        weight = module.weight
        # A plain parameter only: not a DTensor (TP) nor torchao's float8 all-gather wrapper.
        if type(weight) is not nn.Parameter or id(weight) in tied or not weight.requires_grad:
            continue
        copy = weight.detach().to(torch.bfloat16).requires_grad_()
        module.register_buffer("bf16_weight", copy, persistent=False)
        module.__class__ = new_class
        converted += 1
    return converted


def copies(part: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """float32 weight -> its bf16 copy, for the converted layers of part."""
    return {m.weight: m.bf16_weight for m in part.modules() if hasattr(m, "bf16_weight")}


def gradient_holders(parts: list[nn.Module]) -> list[torch.Tensor]:
    """Every parameter of parts, or its bf16 copy where the gradient lands (for the gradient norm)."""
    holders = []
    for part in parts:
        copied = copies(part)
        holders += [copied.get(p, p) for p in part.parameters()]
    return holders


@torch.no_grad()
def refresh(parts: list[nn.Module]) -> None:
    """Copy the float32 weights into their bf16 copies: after anything but the optimizer changed
    the weights (a checkpoint or Hugging Face weights loaded)."""
    for part in parts:
        for weight, copy in copies(part).items():
            copy.copy_(weight)
