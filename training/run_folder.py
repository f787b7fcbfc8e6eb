"""One run per folder: what a dump folder may hold, the lock that keeps a second run out, and what
running the same command again does.

- A run folder holds only what runs write (config.toml, metrics.jsonl, tb/, wandb/, the checkpoint
  folder, run_id, profiles/, previous-<n>/, fault tolerance's replica_<id>/ and logs, .run.lock). A
  non-empty folder holding anything else (a home directory, a dataset, `/`) is refused: a run would
  write into it. checkpoint.folder must name a folder inside it.
- The lock: rank 0 holds an exclusive flock on <folder>/.run.lock from before the resume to its
  exit. The kernel drops a flock on any exit, kill -9 included, so no stale lock outlives a run; the
  file names the holder's pid and host for the line that refuses a second run, on every rank.
  With fault tolerance each replica group locks its own record folder replica_<id>/, and group 0,
  which writes the groups' shared checkpoints while it is live, also the dump folder.
- A rerun: with a checkpoint of this run it continues from it (checkpoint/manager.py); a checkpoint
  at training.steps leaves nothing to do (exit 0, nothing touched), and a training.steps below its
  step is refused. Without one (no checkpointing, or a failure before the first complete
  checkpoint) it starts over: the earlier run's records (metrics.jsonl, tb/, config.toml, wandb/)
  move into previous-<n>/, never deleted, and checkpoints stay where they are.
"""

import dataclasses
import fcntl
import json
import logging
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from checkpoint.loading import latest_step
from checkpoint.run_identity import RUN_ID
from checkpoint.saving import complete_steps
from checkpoint.storage import describe
from configs import UserError, config_to_toml, load_config
from configs.schema import JobConfig
from training.fault_tolerance import record_folder
from training.optimizer import lr_factor

logger = logging.getLogger(__name__)

LOCK = ".run.lock"
RECORDS = ("metrics.jsonl", "tb", "config.toml", "wandb")  # what a run that starts over sets aside
RUN_NAMES = {*RECORDS, "metrics.jsonl.tmp", "profiles", LOCK, RUN_ID}  # (RUN_ID: the run's identity)
# Also written by runs: earlier records, replica groups' folders, logs of the launchers
# (scripts/fault_tolerance_local.sh, `| tee`), and NFS's names for deleted files still open.
RUN_PATTERN = re.compile(r"previous-\d+|replica_\d+|.*\.(log|out|err)|\.nfs.*")
STEP_NAME = re.compile(r"step-(\d+)(\.partial)?")

_held: list[TextIO] = []  # this process's lock files: each lock lasts while its file is open


@dataclasses.dataclass
class RunFolder:
    record_folder: Path  # metrics.jsonl, tb/, config.toml: the dump folder, or replica_<id>/ in it
    finished: bool  # its checkpoint is at training.steps: nothing to do


def claim(config: JobConfig) -> RunFolder:
    """Before anything is built: rank 0 checks the dump folder, decides whether anything is left to
    do, locks the folder and checks where checkpoints will go; every rank learns the verdict, so a
    refusal stops them all with the same line."""
    verdict: list = [None, None]
    if dist.get_rank() == 0:
        try:
            verdict[1] = _claim(config)
        except UserError as e:
            verdict[0] = str(e)
        except OSError as e:  # (a folder that cannot be listed, say: the other ranks must not wait)
            verdict[0] = f"job.dump_folder '{config.job.dump_folder}' cannot be used: {describe(e)}"
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UserError(verdict[0])
    return verdict[1]


def release() -> None:
    """Give up this process's locks (at exit they go anyway; one process may run several trainings,
    as the tests' catalog does)."""
    while _held:
        _held.pop().close()


def _claim(config: JobConfig) -> RunFolder:
    dump_folder = Path(config.job.dump_folder)
    checkpoints = checkpoint_folder(config)
    refuse_unless_run_folder(dump_folder, config.checkpoint.folder)
    records = record_folder(dump_folder, config.fault_tolerance)
    step = None
    if config.checkpoint.enable and "train" not in config.checkpoint.exclude_from_loading:
        step, _ = latest_step(config.checkpoint, checkpoints)
    last = config.training.steps
    if step is not None and step == last:
        logger.info(
            f"nothing to do: step {last} is the last (training.steps); raise training.steps to train further"
        )
        return RunFolder(records, finished=True)
    if step is not None and step > last:
        raise UserError(cut_message(checkpoints, step, last))
    ft = config.fault_tolerance
    if not ft.enable or ft.replica_id == 0:
        lock(dump_folder)
    if ft.enable:
        lock(records)
    if config.checkpoint.enable:
        check_checkpoint_target(checkpoints, first=(step or 0) + 1, last=last)
    return RunFolder(records, finished=False)


def checkpoint_folder(config: JobConfig) -> Path:
    """<dump_folder>/<checkpoint.folder>, which must stay inside the dump folder."""
    relative = Path(config.checkpoint.folder)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise UserError(
            f"checkpoint.folder '{config.checkpoint.folder}' must name a folder inside job.dump_folder, "
            'e.g. "checkpoint" (not an absolute path, not one with ..)'
        )
    return Path(config.job.dump_folder) / relative


def refuse_unless_run_folder(folder: Path, checkpoint_folder: str) -> None:
    """A folder that exists must be empty or hold only what runs write (the module's docstring):
    anything else means it is not a run's, and a run would write into it."""
    if not folder.is_dir():
        return  # made by the lock, or refused there as unwritable
    ours = {*RUN_NAMES, Path(checkpoint_folder).parts[0]}
    foreign = sorted(entry.name for entry in folder.iterdir() if not _written_by_runs(entry, ours))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(
            f"job.dump_folder '{folder}' is not a run folder: it holds {shown}, which no run writes; "
            "choose a new or empty folder"
        )


def _written_by_runs(entry: Path, ours: set[str]) -> bool:
    if entry.name in ours or RUN_PATTERN.fullmatch(entry.name):
        return True
    try:  # a checkpoint folder of another checkpoint.folder setting
        return entry.is_dir() and any(STEP_NAME.match(child.name) for child in entry.iterdir())
    except OSError:
        return False


def lock(folder: Path) -> None:
    """Hold <folder>/.run.lock until this process ends (or release()); refuse if a run holds it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        file = open(folder / LOCK, "a+")  # (not truncated: the holder's pid stays readable)
    except OSError as e:
        raise UserError(f"job.dump_folder '{folder}' cannot be written: {e.strerror}") from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = _holder(file.read())
        file.close()
        raise UserError(
            f"job.dump_folder '{folder}' is in use by another run ({holder}): one run per folder; wait "
            "for it to end, or choose another job.dump_folder"
        ) from None
    except OSError as e:  # a filesystem without working locks (ENOLCK, EOPNOTSUPP, ENOSYS)
        logger.warning(f"{folder / LOCK} cannot be locked ({e.strerror}): a second run would not be refused")
    file.seek(0)
    file.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n")
    file.flush()
    _held.append(file)


def _holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "it has not written its pid yet"


def cut_message(folder: Path, step: int, last: int) -> str:
    earlier = [s for s in complete_steps(folder) if s <= last]
    back = f", or go back to an earlier checkpoint: --checkpoint.load_step {earlier[-1]}" if earlier else ""
    return (
        f"training.steps {last} is below the step of the checkpoint this run continues, "
        f"{folder / f'step-{step}'}: raise training.steps to {step} or more{back}"
    )


def check_checkpoint_target(folder: Path, first: int, last: int) -> None:
    """Where this run's saves go can be written, now rather than at the first save: the checkpoint
    folder (or the nearest folder above it) is a writable folder, and no file sits at a step-N (or
    step-N.partial) this run may save (steps first..last: a stop signal saves any step)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"checkpoint folder {folder} cannot be made: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"checkpoint folder {existing} is not writable: no checkpoint could be saved")
    if existing != folder:
        return
    for entry in folder.iterdir():
        match = STEP_NAME.fullmatch(entry.name)
        if match and first <= int(match.group(1)) <= last and not entry.is_dir():
            raise UserError(
                f"{entry} is a file where this run would save checkpoint step-{match.group(1)}: move it "
                "away or choose another job.dump_folder"
            )


def start_records(run: RunFolder, config: JobConfig, resumed: bool, step: int) -> None:
    """Every check has passed (the resume too): rank 0 sets the earlier records aside unless this run
    continues them, warns if the schedule's lr changes at this step, and writes config.toml. A
    failure to write stops every rank."""
    error = None
    if dist.get_rank() == 0:
        try:
            _start_records(run.record_folder, config, resumed, step)
        except OSError as e:
            error = f"job.dump_folder '{run.record_folder}' cannot be written: {e.strerror}"
    verdict = [error]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UserError(verdict[0])


def _start_records(folder: Path, config: JobConfig, resumed: bool, step: int) -> None:
    previous = previous_config(folder / "config.toml")
    # A resume continues the records of the run that saved (one without checkpointing saved
    # nothing); replica groups continue theirs after a restart, healed from a live peer.
    saver = previous is None or previous.checkpoint.enable
    continued = config.fault_tolerance.enable or (resumed and saver)
    if continued and resumed and previous is not None:
        warn_if_lr_changes(previous, config, step + 1)
    if not continued:
        set_records_aside(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(config_to_toml(config))


def previous_config(path: Path) -> JobConfig | None:
    """The config an earlier run in this folder wrote (None: none, or one this version cannot read)."""
    if not path.is_file():
        return None
    try:
        return load_config(["--config", str(path)])
    except (UserError, OSError):
        return None


def set_records_aside(folder: Path) -> None:
    """Move an earlier run's records into previous-<n>/ (the next free n), saying so in one line."""
    found = [name for name in RECORDS if (folder / name).exists()]
    if not found:
        return
    taken = [int(m.group(1)) for p in folder.iterdir() if (m := re.fullmatch(r"previous-(\d+)", p.name))]
    target = folder / f"previous-{max(taken, default=0) + 1}"
    target.mkdir()
    for name in found:
        (folder / name).rename(target / name)
    logger.info(
        f"the records of an earlier run with no checkpoint to continue ({', '.join(found)}) moved to "
        f"{target}: this run's start anew"
    )


def warn_if_lr_changes(previous: JobConfig, config: JobConfig, step: int) -> None:
    """The lr is a function of the step, training.steps, lr_scheduler and optimizer.lr: a resume that
    changes the last three changes the lr mid-run. Say so once, with the lr step would have had under
    the schedule the checkpoint was trained with and the one it gets."""
    if step > config.training.steps:
        return
    lr = lambda c: c.optimizer.lr * lr_factor(step - 1, c.training.steps, c.lr_scheduler)
    before, after = lr(previous), lr(config)
    if math.isclose(before, after, rel_tol=1e-9):
        return
    settings = {
        "training.steps": (previous.training.steps, config.training.steps),
        "optimizer.lr": (previous.optimizer.lr, config.optimizer.lr),
    }
    for key, value in dataclasses.asdict(previous.lr_scheduler).items():
        settings[f"lr_scheduler.{key}"] = (value, getattr(config.lr_scheduler, key))
    changed = [f"{key} {then} -> {now}" for key, (then, now) in settings.items() if then != now]
    logger.warning(
        f"the learning rate changes mid-run ({', '.join(changed)}): step {step} would have had lr "
        f"{before:.3g}, it gets {after:.3g} (docs/running.md, Extending a run)"
    )
