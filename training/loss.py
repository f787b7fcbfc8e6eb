"""The training loss: cross-entropy summed over tokens; train.py divides by the global token count."""

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
