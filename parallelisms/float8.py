"""Float8 training through torchao: Linear layers compute in float8 with dynamic scaling."""

import dataclasses

import torch
from torch import nn

from configs import UserError
from configs.schema import Float8


def check_float8(config: Float8, device: torch.device, tp_enabled: bool, fsdp_enabled: bool) -> None:
    if not config.enable:
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError("float8.enable needs torchao (pip install torchao)") from None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise UserError(f"float8 needs a GPU of compute capability 8.9 or newer; {name} is not")
    if config.enable_fsdp_float8_all_gather and config.recipe_name != "tensorwise":
        raise UserError("float8.enable_fsdp_float8_all_gather works only with recipe_name = 'tensorwise'")
    if config.precompute_float8_dynamic_scale_for_fsdp and not (
        config.enable_fsdp_float8_all_gather and fsdp_enabled
    ):
        raise UserError(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs enable_fsdp_float8_all_gather and FSDP"
        )


def apply_float8(model: nn.Module, config: Float8, device: torch.device) -> None:
    """Swap nn.Linear for torchao's Float8Linear in place, except filtered or odd-shaped layers.

    On the CPU the float8 matmul is emulated (operands rounded to float8, multiplied in float32):
    the same numerics as on the GPU up to accumulation order, and torch's CPU _scaled_mm is far too
    slow for training (about 60 ms for a 256 x 64 x 128 product, measured with torch 2.13).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = Float8LinearConfig.from_recipe_name(config.recipe_name)
    recipe = dataclasses.replace(
        recipe,
        enable_fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather,
        emulate=device.type == "cpu",
    )

    def keep_float8(module: nn.Module, fqn: str) -> bool:
        if any(name in fqn for name in config.filter_fqns):
            return False
        # float8 matmuls need both dimensions divisible by 16.
        return not isinstance(module, nn.Linear) or (
            module.in_features % 16 == 0 and module.out_features % 16 == 0
        )

    convert_to_float8_training(model, config=recipe, module_filter_fn=keep_float8)


def precompute_float8_scales(model_parts: list[nn.Module], config: Float8) -> None:
    """After the optimizer step: every weight's float8 scale in one pass (FSDP float8 all-gather)."""
    if config.enable and config.precompute_float8_dynamic_scale_for_fsdp:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
