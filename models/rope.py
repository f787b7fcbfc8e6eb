"""YaRN: RoPE frequencies stretched for a longer context than the model was first trained on, and
the attention temperature that goes with them (Peng et al. 2023, as DeepSeek-V2/V3, Kimi K2 and
gpt-oss configure it). One implementation for every family that needs it.

Pairs of dimensions rotating fast (more than beta_fast turns over the original context) keep their
frequency; those rotating slowly (under beta_slow turns) are interpolated, their frequency divided
by `factor`; between the two a linear ramp blends both. Hugging Face's and DeepSeek's reference
round the ramp's ends to whole dimensions, and so does this unless `truncate` is off (gpt-oss's
configuration: the ramp starts and ends between dimensions).
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Yarn:
    factor: float
    """Context extension factor; 1 (or less) = plain RoPE."""
    original_seq_len: int = 4096
    """The context the frequencies were first trained for."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    """Scales log(factor) in the attention temperature of the rotary dimensions (cos and sin)."""
    mscale_all_dim: float = 0.0
    """Scales log(factor) in the temperature of every dimension (the softmax scale, squared);
    0: none. DeepSeek sets both to the same value, which cancels in cos and sin."""
    truncate: bool = True
    """Round the ramp's ends to whole dimensions (Hugging Face's `truncate`, on unless a config says
    otherwise; gpt-oss's says false)."""

    @property
    def enabled(self) -> bool:
        return self.factor > 1


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's temperature: 0.1 x mscale x ln(factor) + 1 (1 without stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, theta: float, yarn: Yarn | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies (dim / 2,) for RoPE over `dim` dimensions, YaRN-stretched."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None or not yarn.enabled:
        return freqs

    def dimension_of(turns: float) -> float:  # the pair index that turns `turns` times over the context
        return dim * math.log(yarn.original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(yarn.beta_fast), dimension_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (as the references do: no division by zero)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)


def rope_amplitude(yarn: Yarn | None) -> float:
    """What cos and sin are multiplied by: mscale's temperature over mscale_all_dim's (which the
    softmax scale carries instead, softmax_scale()); 1 when the two are equal."""
    if yarn is None or not yarn.enabled:
        return 1.0
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor, 1.0)


def attention_temperature(yarn: Yarn | None) -> float:
    """What the attention logits' usual scale (head_dim^-1/2) is multiplied by: mscale_all_dim's
    temperature squared (DeepSeek's MLA applies YaRN's temperature to the whole query-key
    product); 1 without it."""
    if yarn is None or not yarn.enabled or not yarn.mscale_all_dim:
        return 1.0
    return yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
