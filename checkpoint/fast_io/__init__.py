"""The fast checkpoint path (`checkpoint.fast_io = true`, the default), behind the interface of
checkpoint/storage.py: the same DCP files as the plain path, written and read faster.

- staging.py: host copies of the state kept for the run (page-locked on a GPU, in one shareable
  memory file on Linux), refilled by every save; on a GPU the copies overlap training and the next
  optimizer step takes over what is left.
- writer_process.py: async saves written by a process per rank, so that their Python work does not
  slow the training thread.
- writing.py and data_files.py: one rank's DCP save with data files written past the page cache
  (O_DIRECT) and checksummed as they are written, a planner that serializes each repeated value
  once; loads read a rank's files in parallel threads.

The keys checkpoint.async_writer and checkpoint.direct_io belong to this path; writer_threads is
used by both (DCP's writer threads, and this path's reader threads).
"""

import concurrent.futures
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.fast_io.data_files import ParallelReader
from checkpoint.fast_io.staging import Stager
from checkpoint.fast_io.writer_process import WriterProcess, describe_staged
from checkpoint.fast_io.writing import write_files
from checkpoint.storage import Written
from configs.schema import Checkpoint

logger = logging.getLogger(__name__)


class FastIO:
    def __init__(
        self,
        config: Checkpoint,
        rank: int,
        group,
        optimizers: list[torch.optim.Optimizer],
        state: Callable[[], dict],
        wait_for_saves: Callable[[], None],
    ):
        """group: the process group of writes in the background (async saves); optimizers: whose
        first step allocates the host buffers and whose every step takes over their copies; state:
        what a save holds; wait_for_saves: waits for the save in flight, if any."""
        self.threads, self.direct_io, self.rank, self.group = (
            config.writer_threads,
            config.direct_io,
            rank,
            group,
        )
        self.wait_for_saves = wait_for_saves
        # Host copies of the state, refilled by every save: async saves write them in the background;
        # on a GPU blocking saves write them too (into page-locked buffers the copy runs at ~50 GB/s;
        # DCP's own copies into fresh pageable memory ran at ~1.5 GB/s on the H200, slower than the disk).
        self.stager: Stager | None = None
        self.writer: WriterProcess | None = None  # async saves' writer process
        if config.enable and (config.async_mode != "disabled" or torch.cuda.is_available()):
            pinned = config.async_mode != "async"
            in_process = config.async_mode != "disabled" and config.async_writer == "process"
            in_process = in_process and hasattr(os, "memfd_create")  # (Linux; elsewhere a thread)
            if in_process:
                prefix = [f"checkpoint-writers-{uuid.uuid4().hex}/"]  # rank 0's, for the writers' group
                dist.broadcast_object_list(prefix, src=0, group=group)
                self.writer = WriterProcess(rank, dist.get_world_size(), prefix[0])
            self.stager = Stager(pinned, in_process, optimizers, state, self._attach_writer)

    @property
    def writer_name(self) -> str:
        return "writer process" if self.writer is not None else "writer thread"

    def write(self, state: dict, folder: Path, stage: bool = True) -> Written:
        """stage=False: write state as it is (a one-off save, e.g. the last step's model only)."""
        if self.stager is not None and stage:
            state = self.stager.stage_now(state)
        return write_files(state, folder, self.rank, self.threads, self.direct_io)

    def write_later(self, state: dict, folder: Path) -> Callable[[], Written]:
        if self.writer is not None:
            self._write_from_threads_if_a_writer_ended()
        staged = self.stager.stage(state)

        def write() -> Written:
            state = staged.result() if isinstance(staged, concurrent.futures.Future) else staged
            if self.writer is not None:  # (the tensors made after the buffers, if any, sent by value)
                return self.writer.write(
                    describe_staged(self.stager, state), folder, self.threads, self.direct_io
                )
            return write_files(
                state, folder, self.rank, self.threads, self.direct_io, process_group=self.group
            )

        return write

    def reader(self, folder: Path) -> ParallelReader:
        return ParallelReader(folder, self.threads)

    def before_state_changes(self) -> None:
        """The save's host copies still running are taken over first, as the optimizer step's
        pre-hook does (staging.py). (No copies run on unless overlapped: then a no-op.)"""
        if self.stager is not None:
            self.stager.wait()

    def abandon(self) -> bool:
        """An async save is given up: the writer process, stopped or stuck, is killed (its save then
        fails, and its partial folder is removed); True if there was one."""
        if self.writer is None:
            return False
        self.writer.kill()
        return True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _write_from_threads_if_a_writer_ended(self) -> None:
        """Before an async save: if the writer process of any rank has ended (killed, out of memory),
        every rank writes this save and the next from a thread of its training process, as
        async_writer = "thread" does (the writers save as one group: all from processes, or none).
        Without this, the save failed and the run stopped, though training was healthy."""
        ended = self.writer.ended()
        alive = torch.tensor([int(ended is None)])
        if dist.get_world_size(self.group) > 1:  # (no save in flight uses the group now)
            dist.all_reduce(alive, op=dist.ReduceOp.MIN, group=self.group)
        if alive.item():
            return
        self.writer.close()
        self.writer = None
        if ended is not None or self.rank == 0:
            whose = f"the checkpoint writer process ended ({ended})" if ended else "a rank's writer ended"
            logger.warning(
                f"{whose}: this save and the next are written by a thread of the training process instead "
                "(training may run slower while one writes: docs/checkpointing.md)"
            )

    def _attach_writer(self, stager: Stager) -> None:
        if self.writer is None:
            return
        # No save may run meanwhile: it uses the same group and talks to the writer. (None does: the
        # buffers are made at the first update, or, when every update so far was skipped as
        # non-finite, inside the first save's optimizer_state(), whose DCP call runs a zero step,
        # before that save starts. The wait keeps this true if either changes.)
        self.wait_for_saves()
        # The ranks' writers save together (one group): either every rank has shared buffers and
        # writes from its process, or every rank writes from a thread. (A rank whose shared memory
        # was refused, alone in a thread, would leave the others' writers waiting for its own.)
        everywhere = torch.tensor([int(stager.arena is not None)])
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=self.group)
        if everywhere.item():
            self.writer.attach(stager.arena.fd)
        else:  # no shared buffers after all, here or on another rank: write from a thread
            self.writer.close()
            self.writer = None
