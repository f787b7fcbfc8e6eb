"""Getting a save's bytes to disk: host copies for async saves, DCP's writer threads, and what a
failed write is called.

Staging. An async save first copies every tensor it saves to host memory ("staging"), so that training can
change the weights while a background thread writes the copies. torch's DefaultStager keeps its host
buffers between saves when the same stager is used again, so the buffers are allocated (and, for
async_with_pinned_mem, page-locked) by the first save only. With pinned buffers on a GPU the copies
run on a side stream while training goes on; the next optimizer step, the first thing that changes
what is being copied, waits for them (a pre-hook on every optimizer).
"""

import concurrent.futures
import contextlib
import logging
import threading
import time

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from configs.errors import first_line

logger = logging.getLogger(__name__)


class Stager:
    def __init__(self, pinned: bool, optimizers: list[torch.optim.Optimizer]):
        self.overlapped = pinned and torch.cuda.is_available()  # copies overlap training
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=self.overlapped,
                use_shared_memory=False,
                use_async_staging=self.overlapped,
                use_non_blocking_copy=self.overlapped,
            )
        )
        self.copying: concurrent.futures.Future | None = None
        if self.overlapped:
            for optimizer in optimizers:
                optimizer.register_step_pre_hook(lambda *_: self.wait())

    def stage(self, state: dict):
        """The host copy of state, or (overlapped) a future of it."""
        if not self.overlapped:
            return self.stager.stage(state)
        # The side stream's copies must see this step's update, which the GPU may still be running.
        torch.cuda.current_stream().synchronize()
        self.copying = self.stager.stage(state)
        return self.copying

    def wait(self) -> None:
        """Block until the copies are done (they read the weights the caller is about to change)."""
        if self.copying is not None:
            start = time.perf_counter()
            copying, self.copying = self.copying, None
            copying.result()
            waited = time.perf_counter() - start
            logger.info(f"the optimizer step waited {waited:.2f} s for the checkpoint's host copy")


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
