"""Getting a save's bytes to disk: host copies of the state, DCP's writer threads (and the save
planner they serialize records through), and what a failed write is called.

Staging. An async save first copies every tensor it saves to host memory, so that training can
change the weights while a background thread writes the copies; a blocking save on a GPU copies
into the same kept buffers (page-locked) before writing, because DCP's own copies into fresh
pageable memory are slower than the disk (1.4-1.7 GB/s measured on the H200, page faults). The
host buffers are allocated (and, except for `async`, page-locked, which takes seconds and stalls
the GPU's other work) once, right after the first optimizer step, and refilled by every save. With
pinned buffers on a GPU the copies run on a side stream, issued by a staging thread, while
training goes on; the next optimizer step, the first thing that changes what is being copied,
waits for them (a pre-hook on every optimizer). (torch's DefaultStager does the same but fails on
torch 2.11 with `KeyError: <class 'type'>` on this state.)

Serializing. `SaveOnceEachValue`: DCP's save planner with each distinct plain value (the
optimizer's per-parameter hyperparameters) serialized once per save, less Python work in the
writer threads beside training.
"""

import concurrent.futures
import contextlib
import copy
import io
import logging
import shutil
import threading
import time
from collections.abc import Callable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from configs.errors import first_line

logger = logging.getLogger(__name__)


class Stager:
    def __init__(self, pinned: bool, optimizers: list[torch.optim.Optimizer], state: Callable[[], dict]):
        """state: what a save holds (its tensors exist once the first optimizer step made the
        AdamW moments; the buffers are allocated then, off the saves' critical path)."""
        self.overlapped = pinned and torch.cuda.is_available()  # pinned buffers, copies overlap training
        self.buffers: dict[str, torch.Tensor] = {}  # host copy of each tensor, by its path in the state
        self.copying: concurrent.futures.Future | None = None
        if self.overlapped:
            self.stream = torch.cuda.Stream()
            self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="staging")
            for optimizer in optimizers:
                optimizer.register_step_pre_hook(lambda *_: self.wait())

        def allocate_after_first_step(*_) -> None:
            hook.remove()
            start = time.perf_counter()
            self._copy("", state(), fill=False)
            size = sum(buffer.nbytes for buffer in self.buffers.values()) / 1e9
            kind = "pinned " if self.overlapped else ""
            took = time.perf_counter() - start
            logger.info(f"{size:.1f} GB of {kind}host memory for checkpoints, allocated in {took:.1f} s")

        hook = optimizers[-1].register_step_post_hook(allocate_after_first_step)

    def stage(self, state: dict):
        """The host copy of state (tensors into the kept buffers, the rest copied), or (overlapped)
        a future of it."""
        if not self.overlapped:
            return self._copy("", state)
        # The copies wait on the GPU, not here, for this step's update to the weights.
        self.stream.wait_stream(torch.cuda.current_stream())

        def copy_on_side_stream() -> dict:
            with torch.cuda.stream(self.stream):
                staged = self._copy("", state)
            self.stream.synchronize()
            return staged

        self.copying = self.thread.submit(copy_on_side_stream)
        return self.copying

    def stage_now(self, state: dict) -> dict:
        """The host copy of state, complete (for a blocking save)."""
        staged = self.stage(state)
        if self.copying is None:
            return staged
        copying, self.copying = self.copying, None
        return copying.result()

    def wait(self) -> None:
        """Block until the copies are done (they read the weights the caller is about to change)."""
        if self.copying is not None:
            start = time.perf_counter()
            copying, self.copying = self.copying, None
            copying.result()
            waited = time.perf_counter() - start
            logger.info(f"the optimizer step waited {waited:.2f} s for the checkpoint's host copy")

    def _copy(self, path: str, value, fill: bool = True):
        """value with its tensors copied into the buffers kept for their paths (made if missing;
        fill=False only makes them)."""
        if isinstance(value, dict):
            return {key: self._copy(f"{path}/{key}", item, fill) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(f"{path}/{index}", item, fill) for index, item in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        local = value.to_local() if isinstance(value, DTensor) else value
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.overlapped)
            self.buffers[path] = buffer
        if not fill:
            return None
        if local.is_cuda and self.overlapped:
            local.record_stream(self.stream)  # kept alive until the side stream has read it
        buffer.copy_(local.detach(), non_blocking=self.overlapped)
        if isinstance(value, DTensor):  # (from_local would move the buffer back to the mesh's device)
            return DTensor(buffer, value._spec, requires_grad=False)
        return buffer


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
