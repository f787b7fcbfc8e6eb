"""How a checkpoint's bytes reach the disk and come back: the interface that saving and loading use,
and the plain path behind it, torch's own DCP machinery (`checkpoint.fast_io = false`).

A storage does five things for checkpoint/saving.py and checkpoint/loading.py:
    write(state, folder, stage)  a blocking save of this rank's share of state into folder
    write_later(state, folder)   an async save: copies state off the tensors training changes (on
                                 the training thread) and returns the write, which the background
                                 thread then runs
    reader(folder)               the DCP storage reader that a load reads folder with
    before_state_changes()       something other than the optimizer is about to change the state
    abandon()                    an async save is given up (checkpoint/background.py): end what
                                 can be ended of its write; True if something was
and close() at the end of the run. A write returns this rank's files' checksums
(checkpoint/integrity.py) or what went wrong, and the seconds it spent reading files back for them.

PlainDCP: dcp.save through FileSystemWriter, async saves staged by DCP's BlockingAsyncStager
(fresh host memory each save) and written by a thread, loads through FileSystemReader made to read
data only (checkpoint/data_only.py); each rank's files are checksummed by reading them back after
the write. FastIO (checkpoint/fast_io/) writes the same format faster; each reads what the other
wrote. Both readers unpickle nothing but data.
"""

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from checkpoint import integrity
from checkpoint.data_only import DataOnlyReader
from configs.errors import first_line
from configs.schema import Checkpoint

Written = tuple[dict | str, float]  # (this rank's files' checksums, or why the write failed; seconds)


class PlainDCP:
    """checkpoint.fast_io = false: DCP's FileSystemWriter and FileSystemReader (read as data only)."""

    writer_name = "writer thread"

    def __init__(self, config: Checkpoint, rank: int, group=None):
        """group: the process group of writes in the background (async saves)."""
        self.threads, self.rank, self.group = config.writer_threads, rank, group
        self.stager = BlockingAsyncStager()  # (a host copy per save: its cached form needs a GPU)

    def write(self, state: dict, folder: Path, stage: bool = True) -> Written:
        writer = FileSystemWriter(str(folder), thread_count=self.threads)
        return save_files(state, folder, self.rank, writer)

    def write_later(self, state: dict, folder: Path) -> Callable[[], Written]:
        staged = self.stager.stage(state)
        writer = FileSystemWriter(str(folder), thread_count=self.threads)
        return lambda: save_files(staged, folder, self.rank, writer, process_group=self.group)

    def reader(self, folder: Path) -> DataOnlyReader:
        return DataOnlyReader(folder)

    def before_state_changes(self) -> None:
        """Nothing: write_later's copy is complete when it returns."""

    def abandon(self) -> bool:
        """Nothing to end: a thread cannot be stopped (it is a daemon: the process still exits)."""
        return False

    def close(self) -> None:
        """Nothing to release."""


def save_files(
    state: dict, folder: Path, rank: int, writer: StorageWriter, planner: SavePlanner | None = None,
    process_group=None,
) -> Written:  # fmt: skip
    """dcp.save of state into folder through writer: this rank's files' checksums (those the writer
    took as it wrote, in `writer.fs.checksums`, the others read back) or what went wrong, and the
    seconds spent reading files back."""
    errors: list[BaseException] = []
    try:
        with writer_thread_errors(errors):
            dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group)
        if errors:
            return describe(errors[0]) + low_disk_note(folder), 0.0
        own = dict(getattr(getattr(writer, "fs", None), "checksums", {}))
        start = time.perf_counter()
        own.update(integrity.checksum([p for p in integrity.own_files(folder, rank) if p.name not in own]))
        return own, time.perf_counter() - start
    except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
        # A writer thread's failure first: it names its file, where what failed next (.metadata
        # on the same full disk) may not.
        return describe(errors[0] if errors else e) + low_disk_note(folder), 0.0


@contextlib.contextmanager
def writer_thread_errors(errors: list[BaseException]):
    """DCP's extra writer threads (FileSystemWriter thread_count > 1) report a failed write only by
    printing a traceback, and the save then completes without their files (torch 2.11-2.13). Collect
    their exceptions into errors instead, so that the caller fails the save with the cause. When
    the calling thread's own write fails, DCP returns without waiting for its other threads: they
    are waited for here, so that one failing later (a full disk fails them all) prints nothing."""
    previous = threading.excepthook

    def collect(failure) -> None:
        if failure.thread is not None and _WRITER_THREAD in failure.thread.name:
            errors.append(failure.exc_value)
        else:
            previous(failure)

    threading.excepthook = collect
    try:
        yield errors
    finally:
        for thread in threading.enumerate():
            if _WRITER_THREAD in thread.name and thread is not threading.current_thread():
                thread.join()
        threading.excepthook = previous


_WRITER_THREAD = "_write_files_from_queue"  # (in the name Python gives a thread of that function)


def low_disk_note(folder) -> str:
    """ " (its disk has N GB free)" when the disk holding `folder` is nearly full, else "": torch's
    writers report a full disk in words that do not say so (e.g. "unexpected pos 704 vs 598")."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f" (its disk has {free / 1e9:.1f} GB free)" if free < 2**30 else ""


def first_failure(error: BaseException) -> BaseException:
    """The first rank's failure inside DCP's CheckpointException (which says only "CheckpointException
    ranks:dict_keys([0])"); any other error as it is."""
    failures = getattr(error, "failures", None)  # CheckpointException: {rank: exception or (exc, tb)}
    if failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error
    return error


def describe(error: BaseException) -> str:
    """Why a write failed, in a few words: the OS error (e.g. "No space left on device") and its
    file, found inside DCP's CheckpointException, which wraps each rank's failure."""
    error = first_failure(error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f" ({error.filename})" if error.filename else "")
    return f"{type(error).__name__}: {first_line(error)}"
