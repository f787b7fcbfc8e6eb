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

    compile: fuse the float32 upcast with the cross-entropy, so the float32 logits never exist
    in full (not with vocabulary-sharded logits, which are DTensors).
    """

    def __init__(self, num_tokens: int, compile: bool = False) -> None:
        self.num_tokens = num_tokens
        self.cross_entropy_sum = torch.compile(cross_entropy_sum) if compile else cross_entropy_sum

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_sum(logits, labels) / self.num_tokens
