"""The training loss: token cross-entropy summed, divided by the step's global token count.

Dividing by the count over all micro-batches and data-parallel ranks (not each micro-batch's mean)
weighs every token equally, so accumulation and data parallelism give the same gradient as one big
batch. Every label counts (the packer masks none), so the count is known before the step:
global batch x sequence length, with no collective to count it.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses, in float32, over a (batch, seq, vocab) logits tensor.

    Logits sharded over the vocabulary (a DTensor, under loss parallelism) give the same sum.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class TokenNormalizedLoss:
    """loss(logits, labels) = summed token loss / num_tokens (the pipeline schedule calls the same
    object for each of its micro-batches).

    With multi-token prediction (mtp_depth D > 0) the model returns a tuple of logits (the main
    ones, then each depth's) and the labels are (batch, 1 + D, seq): the objective is the main loss
    plus mtp_weight x the mean of the depths' losses (DeepSeek-V3's lambda / D x sum). Each call's
    summed token losses, detached, are kept for take(): the logged `loss` is the main one alone.

    compile_backend: a torch.compile backend ("inductor" fuses the float32 upcast with the
    cross-entropy, so the float32 logits never exist in full), or None (not with vocabulary-sharded
    logits, which are DTensors).
    """

    def __init__(
        self, num_tokens: int, compile_backend: str | None = None, mtp_depth: int = 0, mtp_weight: float = 0.0
    ):
        self.num_tokens = num_tokens
        self.cross_entropy_sum = cross_entropy_sum
        if compile_backend:
            self.cross_entropy_sum = torch.compile(cross_entropy_sum, backend=compile_backend)
        self.mtp_depth, self.mtp_weight = mtp_depth, mtp_weight
        self.recorded: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, tuple):
            main = self.cross_entropy_sum(logits, labels[:, 0] if labels.dim() == 3 else labels)
            self.recorded.append(main.detach().view(1))
            return main / self.num_tokens
        losses = [self.cross_entropy_sum(depth, labels[:, index]) for index, depth in enumerate(logits)]
        self.recorded.append(torch.stack(losses).detach())
        objective = losses[0] + self.mtp_weight / (len(losses) - 1) * sum(losses[1:])
        return objective / self.num_tokens

    def keep_last(self, calls: int) -> None:
        """Forget what calls before the last `calls` recorded (a pipeline's first step: its shape
        inference computes a loss too)."""
        self.recorded = self.recorded[-calls:]

    def take(self, device: torch.device) -> torch.Tensor:
        """The summed token losses recorded since the last take, over num_tokens: (1 + D,), the main
        loss first (zeros where nothing was computed here, e.g. a pipeline stage before the last;
        evaluation records the main loss alone)."""
        total = torch.zeros(1 + self.mtp_depth, device=device)
        for losses in self.recorded:
            total[: losses.numel()] += losses
        self.recorded = []
        return total / self.num_tokens
