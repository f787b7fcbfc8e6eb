"""Held-out loss: every `freq` steps, the same first `steps` global batches of a validation set.

The validation samples are read in the same global order as training data (data/loader.py), each
evaluation from the start, with the training global batch, so the value is the same on every
parallel layout and comparable between evaluations. Token-shard folders separated by commas are
evaluated one by one: val_loss/<name> for each (named as training's sources) and val_loss their mean.
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
        seed: int = 0,
    ):
        self.config = config
        if not config.enable:
            return
        if config.dataset != "python_docs" and not config.dataset_path:
            raise UserError(
                f"validation.dataset_path is required when validation.dataset = '{config.dataset}'"
            )
        if config.dataset == "tokens":
            folders = [folder.strip() for folder in config.dataset_path.split(",") if folder.strip()]
        else:
            folders = [config.dataset_path]
        self.loaders = {}
        for folder in folders:
            source = dataclasses.replace(
                training,
                dataset=config.dataset,
                dataset_path=folder,
                dataset_weights="",
                allow_data_change=False,
            )
            loader = build_dataloader(source, tokenizer, global_batch, dp_rank, dp_degree, seed=seed)
            name = loader.order.source.names[0] if config.dataset == "tokens" else "val"
            self.loaders[name] = (loader, loader.state_dict())

    def due(self, step: int, last_step: int) -> bool:
        return self.config.enable and (step % self.config.freq == 0 or step == last_step)

    def evaluate(self, global_batch_loss: Callable[[list[dict]], float]) -> dict[str, float]:
        """Mean loss over the validation steps (and over the sources, each also apart); global_batch_loss
        returns one batch's global loss."""
        results = {}
        for name, (loader, start_state) in self.loaders.items():
            loader.load_state_dict(start_state)  # the same samples every time
            losses = [global_batch_loss(loader.next_step()) for _ in range(self.config.steps)]
            results[name] = sum(losses) / len(losses)
        loss = sum(results.values()) / len(results)
        per_source = (
            {f"val_loss/{name}": value for name, value in results.items()} if len(results) > 1 else {}
        )
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)), **per_source}
