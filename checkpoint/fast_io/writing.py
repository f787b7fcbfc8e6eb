"""Getting a save's bytes to disk: one rank's DCP save into its files (the same in the training
process for a blocking save and in the writer process, or thread, for an async one), the save planner its
writer threads serialize records through, and what a failed write is called.

Serializing. `SaveOnceEachValue`: DCP's save planner with each distinct plain value (the
optimizer's per-parameter hyperparameters) serialized once per save, less Python work in the
writer threads beside training.
"""

import contextlib
import io
import logging
import shutil
import threading
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from checkpoint import integrity
from checkpoint.data_files import storage_writer
from configs.errors import first_line

logger = logging.getLogger(__name__)


def write_files(
    state: dict, partial: Path, rank: int, writer_threads: int, direct_io: bool, process_group=None
) -> tuple[dict | str, float]:
    """DCP-save state into the folder partial: (this rank's files' checksums, taken while they were
    written, or what went wrong; seconds spent checksumming files read back)."""
    writer = storage_writer(partial, writer_threads, direct_io)
    try:
        with writer_thread_errors() as errors:
            dcp.save(state, storage_writer=writer, planner=SaveOnceEachValue(), process_group=process_group)
        if errors:
            return describe(errors[0]) + low_disk_note(partial), 0.0
        own = writer.fs.checksums
        start = time.perf_counter()  # files named unlike DCP's today (a later torch): read back
        unread = [p for p in integrity.own_files(partial, rank) if p.name not in own]
        own.update(integrity.checksum(unread))
        return own, time.perf_counter() - start
    except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
        return describe(e) + low_disk_note(partial), 0.0


class SaveOnceEachValue(DefaultSavePlanner):
    """DCP's save planner, serializing each distinct plain value once per save.

    DCP stores every non-tensor entry of the state as its own torch.save record, made in the
    writer threads while training runs on. The optimizer's state lists its hyperparameters per
    parameter (lr, betas, eps, ... x 147 parameters = 1,764 records at Llama 3 1B), nearly all
    equal; serializing each takes Python time that, in an async save's writer threads, holds the
    GIL which the training thread needs at every kernel launch (docs/performance.md). Equal plain
    values (None, bool, int, float, str and tuples of them; equal meaning the same type and repr)
    give the same bytes, so each is serialized once and its bytes reused: the files are byte for
    byte what DCP's planner writes."""

    def __init__(self):
        super().__init__()
        self.serialized: dict[tuple, bytes] = {}  # (read and filled from DCP's writer threads)

    def transform_object(self, write_item: WriteItem, object):
        key = _plain_value_key(object) if write_item.type == WriteItemType.BYTE_IO else None
        if key is None:
            return super().transform_object(write_item, object)
        data = self.serialized.get(key)
        if data is None:
            data = self.serialized[key] = super().transform_object(write_item, object).getvalue()
        return io.BytesIO(data)


def _plain_value_key(value) -> tuple | None:
    """A key equal for values that torch.save writes identically; None for anything else."""
    if value is None or type(value) in (bool, int, float, str):
        return (type(value).__name__, repr(value))  # (repr: -0.0 and 0.0 differ, True and 1 too)
    if type(value) is tuple:
        keys = tuple(_plain_value_key(item) for item in value)
        return None if None in keys else ("tuple", keys)
    return None


@contextlib.contextmanager
def writer_thread_errors():
    """DCP's extra writer threads (FileSystemWriter thread_count > 1) report a failed write only by
    printing a traceback, and the save then completes without their files (torch 2.11-2.13). Collect
    their exceptions instead, so that the caller fails the save with the cause."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def collect(args) -> None:
        if args.thread is not None and "_write_files_from_queue" in args.thread.name:
            errors.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = collect
    try:
        yield errors
    finally:
        threading.excepthook = previous


def low_disk_note(folder) -> str:
    """ " (its disk has N GB free)" when the disk holding `folder` is nearly full, else "": torch's
    writers report a full disk in words that do not say so (e.g. "unexpected pos 704 vs 598")."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f" (its disk has {free / 1e9:.1f} GB free)" if free < 2**30 else ""


def describe(error: BaseException) -> str:
    """Why a write failed, in a few words: the OS error (e.g. "No space left on device") and its
    file, found inside DCP's CheckpointException, which wraps each rank's failure."""
    failures = getattr(error, "failures", None)  # CheckpointException: {rank: exception or (exc, tb)}
    if failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f" ({error.filename})" if error.filename else "")
    return f"{type(error).__name__}: {first_line(error)}"
