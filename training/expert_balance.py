"""Mixture-of-Experts bookkeeping after each optimizer step: the layers' token counts summed over
the ranks that hold different tokens, the expert-bias update (DeepSeek-V3's balancing without an
auxiliary loss), and the load statistics the progress line and metrics.jsonl show.

The counts stay on the device: one all-reduce of all layers' counts stacked, no host read, except
at logged steps (statistics()). A model without MoE layers costs nothing.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from models.moe import load_statistics, moe_layers, update_expert_bias
from parallelisms.wrapper_names import original_name
from training import distributed
from training.host_reads import to_host


class ExpertBalance:
    def __init__(
        self,
        model_parts: list[nn.Module],
        tokens_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup | None,
        before_bias_update: Callable[[], None] = lambda: None,
    ):
        """tokens_group: the ranks holding different tokens (data parallel x context parallel);
        tensor-parallel ranks route the same tokens and are not summed. pp_group: pipeline stages
        hold different layers, whose statistics are gathered for the log. before_bias_update:
        called before the biases (saved state) change in place, e.g. to take a running save's
        copies over (Checkpointer.before_state_changes): after an update that a non-finite step
        skipped no optimizer pre-hook has done it."""
        self.layers = {
            original_name(name): moe for part in model_parts for name, moe in moe_layers(part).items()
        }
        self.tokens_group = tokens_group
        self.pp_group = pp_group
        self.before_bias_update = before_bias_update
        self.counts: torch.Tensor | None = None  # the last step's, summed: (layers, experts)
        self.aux_losses: torch.Tensor | None = None  # the last step's mean balance loss per layer

    def after_step(self) -> None:
        """Sum the step's counts over the ranks, move the biases, start counting afresh."""
        if not self.layers:
            return
        layers = list(self.layers.values())
        # One all-reduce: every layer's counts and its summed balance loss side by side.
        summed = torch.stack(
            [torch.cat([moe.tokens_per_expert.float(), moe.aux_loss.view(1)]) for moe in layers]
        )
        summed = distributed.all_reduce_sum(summed, self.tokens_group)
        self.counts = summed[:, :-1]
        self.aux_losses = summed[:, -1] / torch.tensor([moe.sequences_per_step or 1 for moe in layers],
                                                       device=summed.device)  # fmt: skip
        if any(moe.args.bias_update_rate > 0 for moe in layers):
            self.before_bias_update()
        for moe, layer_counts in zip(layers, self.counts):
            if moe.args.bias_update_rate > 0:
                update_expert_bias(moe, layer_counts, moe.args.bias_update_rate)
            moe.tokens_per_expert.zero_()
            moe.aux_loss.zero_()

    def statistics(self) -> dict[str, float]:
        """For the log (reads the device): the most loaded expert over the mean in the worst layer,
        idle experts over all layers, the mean balance loss, and each layer's max load."""
        per_layer = {}
        if self.counts is not None:
            counts, aux_losses = to_host(self.counts, self.aux_losses)
            per_layer = {
                name: {**load_statistics(layer_counts), "aux_loss": aux.item()}
                for name, layer_counts, aux in zip(self.layers, counts, aux_losses)
            }
        if self.pp_group is not None:  # every stage's layers (a host collective, at logged steps only)
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, per_layer, group=self.pp_group)
            per_layer = {name: stats for stage in stages for name, stats in stage.items()}
        if not per_layer:
            return {}
        aux = sum(stats["aux_loss"] for stats in per_layer.values()) / len(per_layer)
        return {
            "moe_max_load": max(stats["max_load"] for stats in per_layer.values()),
            "moe_idle_experts": sum(stats["idle_experts"] for stats in per_layer.values()),
            "moe_aux_loss": aux,
            **{f"moe_max_load/{name}": stats["max_load"] for name, stats in per_layer.items()},
        }
