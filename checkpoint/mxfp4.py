"""MXFP4 weights, as gpt-oss's released checkpoints store their experts: a tensor `X` of ours
(experts, in, out) is stored transposed, as `X_blocks` (experts, out, in / 32, 16) uint8, two 4-bit
values per byte (the low nibble first), and `X_scales` (experts, out, in / 32) uint8, one power of
two per block of 32 values along `in` (the exponent + 127). A 4-bit value is FP4 E2M1: sign, two
exponent bits and one mantissa bit (FP4_VALUES).

Values times their scales are exact in bfloat16 (two significant bits times a power of two), which
is what reading gives. A box of our tensor reads only the rows (out) and the blocks (in) it covers.
"""

import torch

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
VALUES_PER_BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpacked_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Our shape of the tensor that blocks of this shape hold: (..., out, groups, 16) -> (..., in, out)."""
    *leading, rows, groups, _ = blocks_shape
    return (*leading, groups * VALUES_PER_BLOCK, rows)


def scales_fit(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> bool:
    """One scale per block: the scales' shape is the blocks' without the last dimension."""
    whole_blocks = len(blocks_shape) >= 3 and blocks_shape[-1] * 2 == VALUES_PER_BLOCK
    return whole_blocks and scales_shape == blocks_shape[:-1]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., groups, 16) uint8 blocks and (..., groups) uint8 scales -> (..., groups x 32) bfloat16."""
    table = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # (..., groups, 32): low nibble first
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values.float(), exponents.unsqueeze(-1)).to(torch.bfloat16).flatten(-2)


def read_box(blocks, scales, box: tuple[slice, ...]) -> torch.Tensor:
    """The box (slices of our (..., in, out) tensor) from the blocks' and scales' safetensors slices,
    reading only the rows and blocks it covers; (..., in, out) bfloat16."""
    *leading, inputs, outputs = box
    first, end = inputs.start // VALUES_PER_BLOCK, -(-inputs.stop // VALUES_PER_BLOCK)
    stored = (*leading, outputs, slice(first, end))
    values = dequantize(blocks[stored], scales[stored])  # (..., out, whole blocks of in)
    start = inputs.start - first * VALUES_PER_BLOCK
    return values[..., start : start + inputs.stop - inputs.start].transpose(-1, -2)
