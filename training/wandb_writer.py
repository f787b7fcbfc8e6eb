"""Weights & Biases (metrics.enable_wandb): TensorBoard's scalars, the same names and steps, sent from
rank 0.

wandb is optional for training: the config check refuses enable_wandb without the package, in one
line. Its files go under the run's record folder (the dump folder) unless WANDB_DIR names another;
with WANDB_MODE=offline they stay there, for `wandb sync` to upload later. The W&B run's id is kept
in <record folder>/wandb/run_id: a resumed run continues the same W&B run, and a run that starts over
gets a new one, since training/run_folder.py sets the earlier run's wandb/ aside with its records.
"""

import dataclasses
import logging
import os
from pathlib import Path

import torch.distributed as dist

from configs import UserError
from configs.errors import first_line
from configs.schema import JobConfig

logger = logging.getLogger(__name__)

ID_FILE = Path("wandb") / "run_id"  # in the record folder, wherever WANDB_DIR puts W&B's own files


class WandbWriter:
    """One W&B run for this run folder; add_scalars(scalars, step) as TensorBoard's add_scalar."""

    def __init__(self, config: JobConfig, record_folder: Path):
        import wandb

        id_file = record_folder / ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: a new run
        settings = config.metrics
        self.run = wandb.init(
            project=settings.wandb_project or None,  # None: $WANDB_PROJECT, else W&B's default
            entity=settings.wandb_entity or None,  # None: $WANDB_ENTITY, else the key's default
            name=settings.wandb_run_name or os.environ.get("WANDB_NAME") or record_folder.resolve().name,
            id=run_id,
            resume="allow",  # the same id continues the run (offline: each part's files carry it)
            dir=None if os.environ.get("WANDB_DIR") else str(record_folder),
            config=dataclasses.asdict(config),
            settings=wandb.Settings(quiet=True),  # W&B's own lines kept to where the run is
        )
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id + "\n")
        self.said_skipping = False

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        # W&B takes no step below one it holds: steps redone after a resume keep their first values.
        if step < self.run.step:
            if not self.said_skipping:
                logger.info(f"W&B holds this run up to step {self.run.step - 1}: redone steps are not sent")
            self.said_skipping = True
            return
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_wandb(config: JobConfig, record_folder: Path) -> WandbWriter | None:
    """Rank 0's writer (None elsewhere, or when metrics.enable_wandb is off). A W&B run that cannot
    start (no login, no network) stops every rank with one line."""
    if not config.metrics.enable_wandb:
        return None
    writer, error = None, None
    if dist.get_rank() == 0:
        try:
            writer = WandbWriter(config, record_folder)
        except Exception as e:  # wandb's errors have no common type (login, network, settings)
            error = (
                f"metrics.enable_wandb: W&B could not start ({first_line(e)}); run `wandb login`, or set "
                "WANDB_MODE=offline to keep the run's W&B files in the dump folder"
            )
    verdict = [error]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UserError(verdict[0])
    return writer
