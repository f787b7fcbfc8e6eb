"""Which run a checkpoint belongs to, so that a resume continues this run and never another by mistake.

A step-N folder that is a symbolic link to another run's folder would load that run's state (as
that run changes it), and one copied in from another run would be resumed as if this run had saved
it. So a run has an identity: a random id in <job.dump_folder>/run_id, made by the run's first save
(or adopted, below) and recorded in each checkpoint it saves ("run_id" in checksums.json). A resume:
- refuses a step folder that is a symbolic link (checkpoint/loading.py, latest_step): copy it;
- loads a checkpoint of this folder's run;
- in a folder whose run has no identity yet (a new folder, a checkpoint copied into it on purpose)
  loads it and adopts its identity: the folder continues that run;
- refuses another run's checkpoint in a folder whose run has an identity, unless
  checkpoint.allow_other_run (checkpoint.initial_load_path starts a new run from another's weights);
- loads a checkpoint saved before identities were recorded, with a note.
The file is created once, with O_EXCL, and never replaced: replica groups of fault tolerance that
resume together agree on it.
"""

import logging
import os
import re
import time
import uuid
from pathlib import Path

from configs import UserError

logger = logging.getLogger(__name__)
RUN_ID = "run_id"  # the file in the dump folder, and the key in checksums.json
WELL_FORMED = re.compile(r"[0-9a-f]{16}")


def of_folder(dump_folder: Path) -> str | None:
    """The identity of the run this folder holds; None if it has none yet."""
    path = dump_folder / RUN_ID
    for _ in range(20):  # (created and written at once: empty only for the moment between)
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UserError(f"{path} cannot be read: {e.strerror}") from None
        if text:
            break
        time.sleep(0.05)
    if not WELL_FORMED.fullmatch(text):
        raise UserError(
            f"{path} is damaged (it holds no run id): delete it, and the next resume adopts the identity "
            "of the checkpoint it loads"
        )
    return text


def for_saves(dump_folder: Path) -> str:
    """The identity this run's checkpoints record: the folder's, made now if it has none (a run
    that started fresh, or resumed a checkpoint saved before identities were recorded)."""
    return of_folder(dump_folder) or _create(dump_folder, uuid.uuid4().hex[:16])


def adopt(dump_folder: Path, run_id: str | None) -> None:
    """After a resume: a folder without an identity takes that of the checkpoint it resumed."""
    if run_id is None:
        return
    try:
        if of_folder(dump_folder) is None:
            _create(dump_folder, run_id)
    except (OSError, UserError) as e:  # (rank 0 alone: not a reason to stop the others)
        logger.warning(f"{dump_folder / RUN_ID} could not be written ({e}): the next save makes another")


def check(checkpoint: Path, manifest: dict | None, dump_folder: Path, allow_other_run: bool) -> str | None:
    """Before a resume: refuse a checkpoint of another run (unless allowed). Returns the identity
    the folder adopts once the resume has succeeded (None: nothing to adopt)."""
    theirs = manifest.get(RUN_ID) if manifest is not None else None
    if theirs is None:
        if manifest is not None:  # (one without checksums.json is warned about as a whole)
            logger.info(f"{checkpoint} was saved before checkpoints recorded their run: loaded as this run's")
        return None
    ours = of_folder(dump_folder)
    if ours is None or ours == theirs:
        return theirs
    if allow_other_run:
        logger.warning(
            f"checkpoint {checkpoint} is another run's (run {theirs}; this folder's run is {ours}): "
            "resumed as checkpoint.allow_other_run asks; this run's saves stay its own"
        )
        return None
    raise UserError(
        f"checkpoint {checkpoint} belongs to another run (run {theirs}; this folder's run is {ours}), so "
        "it was not loaded: to continue that run copy its step folder into a new job.dump_folder (which "
        "adopts its run), to resume it here anyway set checkpoint.allow_other_run, to start from its "
        "weights use checkpoint.initial_load_path"
    )


def _create(dump_folder: Path, run_id: str) -> str:
    """Write the folder's identity unless one is there already (then that one stands)."""
    try:
        descriptor = os.open(dump_folder / RUN_ID, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return of_folder(dump_folder)
    try:
        os.write(descriptor, f"{run_id}\n".encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return run_id
