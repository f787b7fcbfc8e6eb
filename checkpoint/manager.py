"""The checkpointer train.py holds: saving (checkpoint/saving.py) and resuming (checkpoint/loading.py)
through one storage (checkpoint/storage.py: plain DCP, or the fast path of checkpoint/fast_io/).

Re-running the same command resumes from the latest complete checkpoint in
<dump_folder>/<checkpoint.folder>, on any layout and world size; without one,
checkpoint.initial_load_path gives starting weights. docs/checkpointing.md has the whole story.
"""

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from checkpoint import integrity, loading, run_identity
from checkpoint.fast_io import FastIO
from checkpoint.saving import Saver, report_leftovers, warn_about_unused_saving_keys
from checkpoint.state import PARTS, Checkpointed, TrainState
from checkpoint.storage import PlainDCP
from configs.schema import Checkpoint


class Checkpointer:
    def __init__(
        self,
        config: Checkpoint,
        dump_folder: Path,
        model_parts: list[nn.Module],
        optimizers,
        dataloader,
        train_state: TrainState,
        adapter,
        total_steps: int,
        saves_here: Callable[[], bool] = lambda: True,
        stop_requested: Callable[[], str | None] = lambda: None,
    ):
        """saves_here: whether this process's group saves a checkpoint that is due (with fault
        tolerance one replica group saves for all); stop_requested: the stop signal this process
        received, if any (a wait for a background save gives up on one: checkpoint/background.py)."""
        self.saves_here = saves_here
        self.config, self.folder, self.adapter = config, dump_folder / config.folder, adapter
        self.dump_folder = dump_folder
        self.checkpointed = Checkpointed(model_parts, optimizers.parts, train_state, dataloader)
        rank = dist.get_rank()
        # Async saves run collectives from a background thread: give them their own group.
        group = dist.new_group(backend="gloo") if config.async_mode != "disabled" else None
        if config.fast_io:
            self.storage = FastIO(config, rank, group, optimizers.parts, self.checkpointed.state, self.wait)
        else:
            self.storage = PlainDCP(config, rank, group)
        self.saver = Saver(config, self.folder, self.storage, group, total_steps, self._saved_state,
                           dump_folder, stop_requested)  # fmt: skip
        if not config.enable and rank == 0:
            warn_about_unused_saving_keys(config)

    def _saved_state(self, model_only: bool) -> dict:
        if not model_only:
            return self.checkpointed.state(PARTS)
        dtype = getattr(torch, self.config.export_dtype)
        return {
            "model": {name: t.to(dtype) for name, t in self.checkpointed.state(("model",))["model"].items()}
        }

    def load(self) -> bool:
        """Resume from a checkpoint of this run, or load initial weights; True if resumed."""
        if self.config.enable and dist.get_rank() == 0:
            report_leftovers(self.folder)
        step, hint = loading.latest_step(self.config, self.folder)  # (a symbolic link is refused)
        if step is not None:
            parts = [p for p in PARTS if p not in self.config.exclude_from_loading]
            path = self.path(step)
            run_id = run_identity.check(
                path, integrity.read_manifest(path), self.dump_folder, self.config.allow_other_run
            )
            reader = self.storage.reader(path)
            loading.resume(path, self.checkpointed, parts, reader, self.config.allow_model_change, hint)
            loading.set_aside_later(self.folder, step)
            if dist.get_rank() == 0:  # (a folder without an identity continues the checkpoint's run)
                run_identity.adopt(self.dump_folder, run_id)
            return True
        if self.config.initial_load_path:
            loading.load_initial_weights(
                self.checkpointed.model_parts,
                self.adapter,
                Path(self.config.initial_load_path),
                self.storage.reader,
            )
        return False

    def due(self, step: int, stopping: bool = False) -> bool:
        """Whether to save after this step: every interval steps, at the last step, and when the
        run stops on a signal (if checkpointing is on)."""
        return (self.saver.due(step) or (stopping and self.config.enable)) and self.saves_here()

    def path(self, step: int) -> Path:
        """Where checkpoint step-<step> is once complete."""
        return self.saver.path(step)

    def save(self, step: int, blocking: bool = False) -> Path:
        return self.saver.save(step, blocking)

    def wait(self) -> None:
        """Wait for the background save, if any; raise what stopped it."""
        self.saver.wait()

    def before_state_changes(self) -> None:
        """Something other than the optimizer is about to change the state in place (a torchft
        group healing from a peer, MoE's expert-bias update): a save's host copies still running
        are taken over first."""
        self.storage.before_state_changes()

    def close(self) -> None:
        """At the end of training: the background save and deletion finished, the storage closed."""
        try:
            self.saver.close()
        finally:
            self.storage.close()
