"""MuonClip: Kimi K2's QK-clip. After each optimizer step, every attention head whose largest
attention logit in the step exceeded `optimizer.qk_clip_threshold` has its query and key weights
scaled down so that logit would have been the threshold: its logits multiply by threshold / max.
How that factor splits between a model's weights is the model's (its attention module's
qk_clip_scales: per-head query and key rows for Llama 3 and MLA, the shared QK-norm weights for
Qwen3). Kimi K2 pairs it with Muon, whose updates let logits grow; it works with any optimizer.

The logit maximum: the attention kernels (cuDNN, flash, flex) do not return it, so a forward
pre-hook on each attention kernel computes q k^T / sqrt(d) once more, in chunks of queries under
the causal mask, and keeps each local head's maximum in a buffer (written in place: it compiles
into the block's graph). A document mask is not applied: the causal window's maximum bounds it from
above, so a head is clipped at most a little early. Cost: one more QK^T product per attention in
forward (and in the recomputed forward under activation checkpointing), about a sixth of
attention's FLOPs. The maxima are gathered over tensor parallelism's heads and reduced over the
data-parallel ranks (one small all-gather and all-reduce per step) and read once on the host.
Not with context parallelism: a rank holds its chunk's keys only (refused).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from configs import UserError

QUERY_CHUNK = 256  # queries per logits block: (batch, heads, 256, seq) floats at a time


def max_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each head's largest causal attention logit: q (batch, heads, seq, dim), k with as many
    heads or a divisor of them (GQA); scaled by dim^-1/2 as SDPA scales."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    seq, best = q.shape[2], q.new_full((q.shape[1],), float("-inf"), dtype=torch.float32)
    for start in range(0, seq, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, seq)
        logits = (q[:, :, start:end] @ k[:, :, :end].transpose(-1, -2)).float() * q.shape[-1] ** -0.5
        queries = torch.arange(start, end, device=q.device)[:, None]
        later = torch.arange(end, device=q.device)[None] > queries
        best = torch.maximum(best, logits.masked_fill(later, float("-inf")).amax(dim=(0, 2, 3)))
    return best


def _record(kernel: nn.Module, inputs: tuple) -> None:
    q, k = inputs[0], inputs[1]
    if callable(inputs[2]):  # the latent kernel's (q, latent, expand, mask): keys from the latent
        k = inputs[2](inputs[1])[0]
    with torch.no_grad():
        kernel.max_logits.copy_(torch.maximum(kernel.max_logits, max_logits(q.detach(), k.detach())))


@torch.no_grad()
def scale_rows_(param: torch.Tensor, scale: torch.Tensor) -> None:
    """param *= scale along dim 0, for a plain or DTensor parameter (scale: the whole dim 0)."""
    scale = scale.to(param.dtype).view(-1, *[1] * (param.ndim - 1))
    if isinstance(param, DTensor):  # a replicated factor: each rank multiplies its own rows
        mesh = param.device_mesh
        scale = DTensor.from_local(scale, mesh, [Replicate()] * mesh.ndim, run_check=False)
    param.mul_(scale)


class QKClip:
    """The attention modules of the model parts (those with qk_clip_scales), the hooks measuring
    their logits, and the clipping after each step."""

    def __init__(self, model_parts: list[nn.Module], threshold: float, device: torch.device, tp: int = 1,
                 tp_group=None, dp_group=None):  # fmt: skip
        """tp_group: the ranks that split the heads (tp of them); dp_group: the ranks that hold the
        same heads and see other tokens."""
        self.threshold, self.tp, self.tp_group, self.dp_group = threshold, tp, tp_group, dp_group
        self.attentions = [m for part in model_parts for m in part.modules() if hasattr(m, "qk_clip_scales")]
        for attention in self.attentions:
            heads = torch.full((attention.n_heads // tp,), float("-inf"), device=device)
            attention.kernel.register_buffer("max_logits", heads, persistent=False)
            attention.kernel.register_forward_pre_hook(_record)

    @torch.no_grad()
    def after_step(self, skip: torch.Tensor | None = None) -> None:
        """Clip the heads whose logits exceeded the threshold since the last call (none if the step
        was skipped), and start measuring anew."""
        if not self.attentions:
            return
        maxima = torch.stack([a.kernel.max_logits for a in self.attentions])  # (layers, local heads)
        if self.tp_group is not None:  # heads are split over TP ranks in order
            shares = [torch.empty_like(maxima) for _ in range(self.tp)]
            dist.all_gather(shares, maxima, group=self.tp_group)
            maxima = torch.cat(shares, dim=1)
        if self.dp_group is not None:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.dp_group)
        factors = (self.threshold / maxima).clamp(max=1.0)
        if skip is not None:
            factors = torch.where(skip > 0, torch.ones_like(factors), factors)
        if bool((factors < 1).any()):
            for attention, clip in zip(self.attentions, factors):
                for name, scale in attention.qk_clip_scales(clip).items():
                    scale_rows_(attention.get_parameter(name), scale)
        for attention in self.attentions:
            attention.kernel.max_logits.fill_(float("-inf"))


def qk_clip_for(model_parts: list[nn.Module], threshold: float, dims, mesh, device) -> QKClip | None:
    """The run's QKClip; None when optimizer.qk_clip_threshold is 0 (off)."""
    if not threshold:
        return None
    if dims.cp > 1:
        raise UserError("optimizer.qk_clip_threshold is not supported with context parallelism")
    clip = QKClip(model_parts, threshold, device, dims.tp, mesh["tp"].get_group() if dims.tp > 1 else None,
                  mesh["dp_cp"].get_group() if mesh["dp_cp"].size() > 1 else None)  # fmt: skip
    if not clip.attentions and not dims.pp_enabled:  # (a pipeline stage may hold no attention)
        raise UserError("optimizer.qk_clip_threshold: this model's attention has no qk_clip_scales")
    return clip
