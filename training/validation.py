"""Held-out loss: every `freq` steps, the same first `steps` global batches of a validation set.

The validation samples are read in the same global order as training data (data/loader.py), each
evaluation from the start, with the training global batch, so the value is the same on every
parallel layout and comparable between evaluations.
"""

import dataclasses
import math
from collections.abc import Callable

from configs import UserError
from configs.schema import Training, Validation
from data.loader import build_dataloader
from data.tokenizer import Tokenizer


class Validator:
    def __init__(
        self,
        config: Validation,
        training: Training,
        tokenizer: Tokenizer,
        global_batch: int,
        dp_rank: int,
        dp_degree: int,
    ):
        self.config = config
        if not config.enable:
            return
        if config.dataset != "python_docs" and not config.dataset_path:
            raise UserError(
                f"validation.dataset_path is required when validation.dataset = '{config.dataset}'"
            )
        source = dataclasses.replace(training, dataset=config.dataset, dataset_path=config.dataset_path)
        self.loader = build_dataloader(source, tokenizer, global_batch, dp_rank, dp_degree)
        self.start_state = self.loader.state_dict()

    def due(self, step: int, last_step: int) -> bool:
        return self.config.enable and (step % self.config.freq == 0 or step == last_step)

    def evaluate(self, global_batch_loss: Callable[[list[dict]], float]) -> dict[str, float]:
        """Mean loss over the validation steps; global_batch_loss returns one batch's global loss."""
        self.loader.load_state_dict(self.start_state)  # the same samples every time
        losses = [global_batch_loss(self.loader.next_step()) for _ in range(self.config.steps)]
        loss = sum(losses) / len(losses)
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}
