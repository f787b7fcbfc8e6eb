"""The training loss: token cross-entropy summed, divided by the step's global token count.

Dividing by the count over all micro-batches and data-parallel ranks (not each micro-batch's mean)
weighs every token equally, so accumulation and data parallelism give the same gradient as one big
batch.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100  # label of a position that does not count (none with plain packing)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses, in float32, over a (batch, seq, vocab) logits tensor.

    Logits sharded over the vocabulary (a DTensor, under loss parallelism) give the same sum.
    """
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class TokenNormalizedLoss:
    """loss(logits, labels) = summed token loss / num_tokens; train.py sets num_tokens every step
    (the pipeline schedule calls the same object for each of its micro-batches).

    compile: fuse the float32 upcast with the cross-entropy, so the float32 logits never exist
    in full (not with vocabulary-sharded logits, which are DTensors).
    """

    def __init__(self, compile: bool = False) -> None:
        self.num_tokens = 1.0
        self.cross_entropy_sum = torch.compile(cross_entropy_sum) if compile else cross_entropy_sum

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_sum(logits, labels) / self.num_tokens
