"""Saving: DCP checkpoints that appear only when complete.

Layout on disk, under <dump_folder>/<checkpoint.folder>:
    step-500/          a complete checkpoint (DCP files + .metadata + checksums.json)
    step-1000.partial/ a save in progress (or killed): never loaded, never counted
    step-100.deleting/ an old checkpoint being deleted (keep_latest_k), in the background
    step-800.abandoned a later checkpoint set aside when a run resumed from an earlier step
    step-600.incomplete-1  what sat at step-600 without .metadata when step 600 was saved again
    step-600.replaced-1    an older complete save of step 600 (e.g. exclude_from_loading "train")
A save is written to step-N.partial by every rank (through the storage: checkpoint/storage.py),
then rank 0 writes checksums.json (every file's checksum, checkpoint/integrity.py) and renames the
folder step-N once every rank has finished (DCP writes .metadata last, after all ranks' data). A
save that fails on any rank fails on every rank, its partial folder removed, the previous complete
checkpoint untouched. A save deletes nothing it did not write: what was already at its step-N is
renamed aside, and only complete checkpoints are ever deleted (keep_latest_k). checksums.json names
the run that saved it (checkpoint/run_identity.py). An async save is written by a background thread
(checkpoint/background.py), waited for at the next save with a bound, and given up past it.
"""

import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from checkpoint import integrity, run_identity
from checkpoint.background import BackgroundSave, local_bytes
from checkpoint.storage import describe
from configs import UserError
from configs.schema import Checkpoint

logger = logging.getLogger(__name__)
STEP_FOLDER = re.compile(r"^step-(\d+)$")
GIVING_UP_S = 10.0  # how long a given-up save's thread may take to clear its partial folder


def complete_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in folder, oldest first."""
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.iterdir():
        match = STEP_FOLDER.match(path.name)
        if match and (path / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def report_leftovers(folder: Path) -> None:
    """At start-up, on rank 0: warn about what is there but never loaded (saves that did not finish,
    step folders without .metadata) and finish the deletions of old checkpoints a kill interrupted."""
    for path in sorted(folder.glob("step-*")):
        if path.name.endswith(".partial"):
            logger.warning(f"ignoring {path}: a save that did not finish (delete it to free space)")
        elif STEP_FOLDER.match(path.name) and not (path / ".metadata").is_file():
            logger.warning(
                f"ignoring {path}: not a complete checkpoint (no .metadata), never loaded; a save of "
                "this step renames it aside, never deletes it"
            )
    for doomed in folder.glob("step-*.deleting"):  # renamed by keep_latest_k: complete, old, doomed
        _delete(doomed)


def set_aside(path: Path) -> Path:
    """Rename what sits where a save is about to put a complete checkpoint: <name>.replaced-<k> if it
    is an older complete one, else <name>.incomplete-<k> (never deleted: it may be anything)."""
    kind = "replaced" if (path / ".metadata").is_file() else "incomplete"
    k = 1
    while path.with_name(f"{path.name}.{kind}-{k}").exists():
        k += 1
    target = path.rename(path.with_name(f"{path.name}.{kind}-{k}"))
    what = "an older save of this step" if kind == "replaced" else "not a complete checkpoint"
    logger.warning(f"{path} was already there ({what}): renamed {target.name} (delete it to free space)")
    return target


def _delete(checkpoint: Path) -> None:
    """Delete an old checkpoint; a symbolic link (to another run's, never loaded) only as a link."""
    if checkpoint.is_symlink():
        checkpoint.unlink(missing_ok=True)
    else:
        shutil.rmtree(checkpoint, ignore_errors=True)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Saver:
    def __init__(
        self, config: Checkpoint, folder: Path, storage, group, total_steps: int,
        state: Callable[[bool], dict], dump_folder: Path,
        stop_requested: Callable[[], str | None] = lambda: None,
    ):  # fmt: skip
        """storage: checkpoint/storage.py's interface; group: the process group of saves in the
        background; state(model_only): what a save holds; dump_folder: where the run's identity is;
        stop_requested: the stop signal received, if any (a wait for a background save ends on one)."""
        self.config, self.folder, self.storage, self.group = config, folder, storage, group
        self.total_steps, self.state, self.dump_folder = total_steps, state, dump_folder
        self.stop_requested = stop_requested
        self.is_rank0 = dist.get_rank() == 0
        self.pending: BackgroundSave | None = None  # the async save in flight
        self.given_up = False  # a background save was given up: the run is stopping
        self.deleting: threading.Thread | None = None  # deleting checkpoints beyond keep_latest_k

    def due(self, step: int) -> bool:
        return self.config.enable and (step % self.config.interval == 0 or step == self.total_steps)

    def path(self, step: int) -> Path:
        """Where checkpoint step-<step> is once complete."""
        return self.folder / f"step-{step}"

    def save(self, step: int, blocking: bool = False) -> Path:
        """Write checkpoint step-<step>; returns its final path (complete once committed). A save that
        fails (disk full, folder gone, any write error) stops the run with a UserError on every rank:
        its partial folder is removed and the previous complete checkpoint is untouched."""
        start = time.perf_counter()  # (training is blocked from here until this returns)
        self.wait()  # one save in flight at a time
        final, partial = self.path(step), self.folder / f"step-{step}.partial"
        error = None
        if self.is_rank0:
            try:
                if partial.exists():
                    shutil.rmtree(partial)  # left by a save of this step that was killed
                partial.mkdir(parents=True)
            except OSError as e:
                error = describe(e)
        self._agree(partial, final, error)
        model_only = self.config.last_save_model_only and step == self.total_steps
        state = self.state(model_only)
        if self.config.async_mode == "disabled" or blocking or model_only:
            own, checksum_seconds = self.storage.write(state, partial, stage=not model_only)
            self._finish(own, partial, final)
            size = sum(f.stat().st_size for f in final.iterdir()) / 1e9 if self.is_rank0 else 0
            logger.info(
                f"saved checkpoint {final} in {time.perf_counter() - start:.1f} s ({size:.1f} GB; "
                f"checksums {checksum_seconds:.1f} s of it)"
            )
        else:
            write = self.storage.write_later(state, partial)
            # Written, checksummed and committed in the background, as soon as the write ends.
            self.pending = BackgroundSave(
                lambda: self._save_in_background(write, partial, final, start), step, local_bytes(state),
                self.config.async_min_write_mb_per_s,
            )  # fmt: skip
            logger.info(
                f"saving checkpoint {final} in the background by the {self.storage.writer_name} "
                f"(training blocked {time.perf_counter() - start:.1f} s)"
            )
        return final

    def _save_in_background(self, write: Callable, partial: Path, final: Path, start: float) -> None:
        try:
            own, _ = write()
        except Exception as e:  # (every rank must reach _finish's collective, or the others wait there)
            own = f"{type(e).__name__}: {e}"
        if self.given_up:  # (a write that ends after all is not committed: the run stopped without it)
            own = "given up"
        try:
            self._finish(own, partial, final, self.group)
        except UserError as e:  # raised on every rank at the next save or at the end
            if not self.given_up:  # (then the wait's own error line says it)
                logger.warning(f"{e} (the run stops at its next save)")
            raise
        logger.info(
            f"saved checkpoint {final} (committed {time.perf_counter() - start:.1f} s after it began)"
        )

    def wait(self) -> None:
        """Wait for the background save, if any (it commits itself); raise what stopped it, or a
        UserError if it is given up (too slow, or a stop signal came meanwhile: background.py)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        why = pending.wait(self.stop_requested)
        if why is None:
            return
        self.given_up = True
        if self.storage.abandon():  # (a writer process ended: its save fails and is cleared away)
            try:
                pending.future.exception(timeout=GIVING_UP_S)
            except TimeoutError:
                pass
        latest = complete_steps(self.folder)
        kept = f"{self.path(latest[-1])} is the latest complete one" if latest else "no other is complete"
        raise UserError(f"checkpoint {self.path(pending.step)} could not be saved: {why}; {kept}")

    def close(self) -> None:
        """At the end of training: the background save and deletion finished."""
        try:
            self.wait()
        finally:
            self._wait_for_deletion()

    def _finish(self, own: dict | str, partial: Path, final: Path, group=None) -> None:
        """Every rank has written its files (own: their checksums) or failed (own: why). Rank 0
        writes checksums.json (every rank's files and .metadata) and renames the folder complete."""
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, own, group=group)
        error = next((e for e in everyone if isinstance(e, str)), None)
        if self.is_rank0 and error is None:
            try:
                files = {name: entry for part in everyone for name, entry in part.items()}
                # .metadata, and any data file named unlike DCP names them today (a later torch).
                others = [p for p in sorted(partial.glob("*.distcp")) if p.name not in files]
                files.update(integrity.checksum([*others, partial / ".metadata"]))
                integrity.write_manifest(partial, files, run_identity.for_saves(self.dump_folder))
                if final.exists() or final.is_symlink():
                    set_aside(final)
                _fsync_folder(partial)  # (its files' names on the disk before it is complete)
                partial.rename(final)
                _fsync_folder(self.folder)  # (the rename too, before older checkpoints are deleted)
            except OSError as e:
                error = describe(e)
            except UserError as e:  # (this run's identity file damaged)
                error = str(e)
        self._agree(partial, final, error, group)
        if self.is_rank0:
            self._delete_old_in_background()

    def _agree(self, partial: Path, final: Path, error: str | None, group=None) -> None:
        """Every rank learns rank 0's verdict; on an error every rank raises the same UserError,
        after rank 0 removed the partial folder (the previous checkpoints stay as they are)."""
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0, group=group)
        if verdict[0] is None:
            return
        if self.is_rank0:
            shutil.rmtree(partial, ignore_errors=True)
        latest = complete_steps(self.folder)
        kept = f"{self.path(latest[-1])} is the latest complete one" if latest else "no other is complete"
        raise UserError(f"checkpoint {final} could not be saved: {verdict[0]}; {kept}")

    def _delete_old_in_background(self) -> None:
        """keep_latest_k: delete older complete checkpoints off the critical path (a large
        checkpoint takes seconds to delete, and every rank would wait for rank 0 at its next
        collective)."""
        self._wait_for_deletion()
        keep = self.config.keep_latest_k
        old = complete_steps(self.folder)[:-keep] if keep > 0 else []
        doomed = []
        for step in old:  # renamed first, so that a kill mid-deletion leaves no half checkpoint
            try:
                doomed.append(self.path(step).rename(self.folder / f"step-{step}.deleting"))
            except OSError as e:  # (rank 0 only, after the ranks agreed: not a reason to stop)
                logger.warning(f"keep_latest_k: {self.path(step)} could not be deleted: {describe(e)}")
        if doomed:
            self.deleting = threading.Thread(target=lambda: [_delete(p) for p in doomed])
            self.deleting.start()

    def _wait_for_deletion(self) -> None:
        if self.deleting is not None:
            self.deleting.join()
            self.deleting = None


def warn_about_unused_saving_keys(config: Checkpoint) -> None:
    """Saving keys set with saving off: a recipe may keep them so (resuming keys set without enable
    are errors, configs/schema.py), but a command line that sets one likely forgot enable."""
    defaults = Checkpoint()
    keys = ("folder", "interval", "keep_latest_k", "async_mode", "async_writer", "writer_threads",
            "async_min_write_mb_per_s", "direct_io", "last_save_model_only", "export_dtype")  # fmt: skip
    unused = [f"checkpoint.{key}" for key in keys if getattr(config, key) != getattr(defaults, key)]
    if unused:
        logger.warning(f"{', '.join(unused)} set, but checkpoint.enable is false: no checkpoint is saved")
