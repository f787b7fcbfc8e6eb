"""Host copies of the state that a save writes, kept for the whole run.

An async save first copies every tensor it saves to host memory, so that training can change the
weights while the copies are written in the background; a blocking save on a GPU copies into the
same kept buffers (page-locked) before writing, because DCP's own copies into fresh pageable memory
are slower than the disk (1.4-1.7 GB/s measured on the H200, page faults). The buffers are
allocated once, right after the first optimizer step, and refilled by every save. With pinned
buffers on a GPU the copies run on a side stream, issued by a staging thread, while training goes
on; the next optimizer step, the first thing that changes what is being copied, takes over what is
not copied yet (a pre-hook on every optimizer; _OverlappedCopies). (torch's DefaultStager copies
alike but fails on torch 2.11 with `KeyError: <class 'type'>` on this state.)

On Linux all buffers are views of one `HostArena`: a memory file (memfd) that the writer process
(checkpoint/fast_io/writer_process.py) maps too, so handing a save to it copies nothing, and whose
size /dev/shm's limit does not cap. On a GPU it is page-locked in place (cudaHostRegister) after
its pages were touched by several threads: locking is what made the allocation slow (torch's
default pinned allocator locks ~1.6 GB/s on the H200).
"""

import concurrent.futures
import copy
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)
ALIGN = 4096  # bytes: every buffer starts on a page
TOUCH_THREADS = 8
_ARENAS: list["HostArena"] = []


class HostArena:
    """One block of shareable host memory for every buffer: a memfd of `size` bytes, mapped here."""

    def __init__(self, size: int, pin: bool):
        self.size = max(size, 1)
        self.fd = os.memfd_create("checkpoint-buffers", 0)  # (no close-on-exec: the writer inherits it)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = False
        _ARENAS.append(self)  # kept for the process's life: a later mapping may not reuse a registered range
        if pin:
            pieces = self.bytes.split(1 << 28)  # touched (allocated) in parallel, then locked at once
            with concurrent.futures.ThreadPoolExecutor(TOUCH_THREADS) as pool:
                list(pool.map(lambda piece: piece.fill_(0), pieces))
            result = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.size, 0)
            self.pinned = int(result) == 0
            if not self.pinned:
                _clear_cuda_error()
                why = torch.cuda.cudart().cudaGetErrorString(result)
                logger.warning(f"page-locking the checkpoint buffers failed ({why}); copies will be slower")

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return arena_view(self.bytes, offset, shape, dtype)


def arena_view(arena: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor at offset in an arena's bytes (here or as the writer process maps them)."""
    count = torch.Size(shape).numel() * dtype.itemsize
    return arena[offset : offset + count].view(dtype).view(shape)


def _clear_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error as CUDA's last error, which the next kernel
    launch's check would raise as its own: launch one here, whose check reads (and clears) it."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def arena_layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in one arena (page-aligned), and the arena's size."""
    offsets, size = {}, 0
    for path, tensor in tensors.items():
        offsets[path] = size
        size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return offsets, size


class Stager:
    def __init__(
        self,
        pinned: bool,
        shared: bool,
        optimizers: list[torch.optim.Optimizer],
        state: Callable[[], dict],
        on_allocated: Callable[["Stager"], None] = lambda stager: None,
    ):
        """state: what a save holds (its tensors exist once the first optimizer step made the
        AdamW moments; the buffers are allocated then, off the saves' critical path). shared: the
        buffers in a HostArena (Linux), for a writer process; on_allocated: called after that."""
        self.overlapped = pinned and torch.cuda.is_available()  # pinned buffers, copies overlap training
        self.buffers: dict[str, torch.Tensor] = {}  # host copy of each tensor, by its path in the state
        self.arena: HostArena | None = None
        self.offsets: dict[str, int] = {}  # each buffer's place in the arena
        self.copying: concurrent.futures.Future | None = None
        if self.overlapped:
            self.stream = torch.cuda.Stream()
            self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="staging")
            for optimizer in optimizers:
                optimizer.register_step_pre_hook(lambda *_: self.wait())

        def allocate_after_first_step(*_) -> None:
            hook.remove()
            start = time.perf_counter()
            self._allocate(state(), shared and hasattr(os, "memfd_create"))
            size = sum(buffer.nbytes for buffer in self.buffers.values()) / 1e9
            kind = "pinned " if self.overlapped else ""
            took = time.perf_counter() - start
            logger.info(f"{size:.1f} GB of {kind}host memory for checkpoints, allocated in {took:.1f} s")
            on_allocated(self)

        hook = optimizers[-1].register_step_post_hook(allocate_after_first_step)

    def _allocate(self, state: dict, shared: bool) -> None:
        locals_ = _tensors(state)
        if not shared:
            for path, local in locals_.items():
                self.buffers[path] = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.overlapped)
            return
        offsets, size = arena_layout(locals_)
        try:
            self.arena = HostArena(size, pin=self.overlapped)
        except OSError as e:
            logger.warning(
                f"no shared memory for the checkpoint buffers ({e}); async saves write from a thread"
            )
            return self._allocate(state, shared=False)
        self.offsets = offsets
        for path, local in locals_.items():
            self.buffers[path] = self.arena.view(self.offsets[path], local.shape, local.dtype)

    def stage(self, state: dict):
        """The host copy of state (tensors into the kept buffers, the rest copied), or (overlapped)
        a future of it."""
        if not self.overlapped:
            return self._copy(state, None)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, buffer), issued by the thread
        staged = self._copy(state, copies)
        # The copies wait on the GPU, not here, for this step's update to the weights.
        self.stream.wait_stream(torch.cuda.current_stream())
        self.copies = _OverlappedCopies(copies, self.stream)
        self.copying = self.thread.submit(self.copies.run, staged)
        return self.copying

    def stage_now(self, state: dict) -> dict:
        """The host copy of state, complete (for a blocking save)."""
        staged = self.stage(state)
        if self.copying is None:
            return staged
        copying, self.copying = self.copying, None
        return copying.result()

    def wait(self) -> None:
        """Before the optimizer step, which changes what is being copied: the copies not yet made
        are taken over (see _OverlappedCopies.take_over); the CPU does not wait for them."""
        if self.copying is not None:
            start = time.perf_counter()
            self.copying = None
            snapshot = self.copies.take_over()
            took = time.perf_counter() - start
            logger.info(
                f"the optimizer step took over the checkpoint's host copy in {took:.2f} s "
                f"({snapshot / 1e9:.1f} GB of it snapshotted on the GPU)"
            )

    def in_arena(self, path: str, tensor: torch.Tensor) -> bool:
        """Whether tensor is the arena's buffer for path (a buffer made later, e.g. for a tensor
        that changed shape, is not)."""
        return path in self.offsets and self.buffers.get(path) is tensor

    def _copy(self, state: dict, copies: list | None):
        """state with its tensors copied into the buffers kept for their paths (made if missing);
        copies: a list to add the (source, buffer) pairs to instead of copying them here."""

        def copy_leaf(path: str, value):
            if not isinstance(value, torch.Tensor):
                return copy.deepcopy(value)
            local = value.to_local() if isinstance(value, DTensor) else value
            buffer = self.buffers.get(path)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.overlapped)
                self.buffers[path] = buffer
            if copies is not None and local.is_cuda:
                copies.append((local.detach(), buffer))
            else:
                buffer.copy_(local.detach())
            if isinstance(value, DTensor):  # (from_local would move the buffer back to the mesh's device)
                return DTensor(buffer, value._spec, requires_grad=False)
            return buffer

        return map_leaves(state, copy_leaf)


class _OverlappedCopies:
    """One save's copies from the GPU into pinned host buffers, issued on a side stream by the
    staging thread GROUP_BYTES at a time, the next group issued before waiting for the last, so
    that the optimizer's take-over finds most of the state not yet issued. (Issuing in groups does
    not let a small device-to-host copy of training's pass: measured on the H200, such a copy waits
    until every queued host copy has ended; training reads its values through training/
    host_reads.py instead, which uses no copy.)

    The copies take longer than a step's forward and backward when the state is large (18 GB at
    Llama 3 1B: ~0.33 s at the ~55 GB/s a GPU copies to the host), and the optimizer step must not
    change a tensor before its copy has read it. So the optimizer's pre-hook takes over: the thread
    stops issuing, every tensor not yet issued is snapshotted on the GPU (a device copy, ~1% of the
    time of the host copy), and the thread goes on copying from the snapshots while the optimizer
    and the next steps run; what the GPU has no free memory for is copied from the tensor itself at
    once. The optimizer's kernels wait on the GPU for all of the side stream's work issued by then:
    the copies in flight when the thread stopped, the snapshots, and the copies not snapshotted (the
    CPU does not wait)."""

    GROUP_BYTES = 1 << 28
    SPARE_BYTES = 2 << 30  # GPU memory a snapshot leaves free

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream):
        self.copies, self.stream = copies, stream
        self.issued = 0  # copies[:issued] are on the side stream
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []  # (snapshot, buffer) of the rest
        self.snapshot_bytes = 0  # what the take-over snapshotted
        self.stop, self.stopped, self.handed_over = threading.Event(), threading.Event(), threading.Event()

    def run(self, staged: dict) -> dict:
        """(the staging thread) Issue the copies group by group until done or told to stop, then
        those from the snapshots; return staged once every copy has finished."""
        with torch.cuda.stream(self.stream):
            try:
                self.issued = self._issue_in_groups(self.copies, self.stop)
            finally:  # (a take-over waits for this)
                self.stopped.set()
            if self.issued < len(self.copies):
                self.handed_over.wait()  # (the snapshots are on this stream: copied after them)
                self._issue_in_groups(self.snapshots, None)
        self.stream.synchronize()
        self.snapshots = []
        return staged

    def _issue_in_groups(self, copies: list, stop: threading.Event | None) -> int:
        """Copies issued (all, or those before stop was set), at most two groups in flight."""
        issued, previous = 0, None
        while issued < len(copies) and not (stop is not None and stop.is_set()):
            size = 0
            while issued < len(copies) and (size < self.GROUP_BYTES or size == 0):
                source, buffer = copies[issued]
                source.record_stream(self.stream)  # kept alive until the side stream has read it
                buffer.copy_(source, non_blocking=True)
                size, issued = size + buffer.nbytes, issued + 1
            done = torch.cuda.Event()
            done.record(self.stream)
            if previous is not None:
                previous.synchronize()
            previous = done
        return issued

    def take_over(self) -> int:
        """(the training thread, before the optimizer step) Snapshot the tensors the staging thread
        has not copied yet and hand them back to it; returns the bytes snapshotted.

        The snapshots are made on the side stream, so the CUDA cache gives them the side stream's
        memory (which it keeps for the next saves' snapshots), never the training stream's free
        blocks: those are the next step's activations. (Made on the training stream, as an
        earlier version did, they took those blocks and the next step grew the cache: slowly with expandable
        segments, measured on the H200 with compiled Llama 3 1B as that step at 56-79%; and near
        the memory limit it could have run out.) Device memory the snapshots newly take leaves
        SPARE_BYTES free; the rest is copied straight. The update waits on the GPU for all of it."""
        self.stop.set()
        self.stopped.wait()  # (at most one group's copy)
        try:
            return self._snapshot_the_rest()
        finally:  # (the thread waits for this)
            self.handed_over.set()

    def _snapshot_the_rest(self) -> int:
        rest = self.copies[self.issued :]
        most_taken = 0  # the most new device memory the snapshots can have taken
        # (The side stream is past the last update already: stage() made it wait for it; the
        # backward still running changes none of these tensors, so the snapshots need not wait.)
        with torch.cuda.stream(self.stream):
            free, _ = torch.cuda.mem_get_info()
            reserved = torch.cuda.memory_reserved()
            for source, buffer in rest:
                size = -(-source.nbytes // (2 << 20)) * (2 << 20)  # (the allocator's rounding)
                if most_taken + size > free - self.SPARE_BYTES:  # (unless the side stream's cache holds it)
                    taken = torch.cuda.memory_reserved() - reserved  # new device memory so far
                    if taken + size > free - self.SPARE_BYTES:
                        break
                source.record_stream(self.stream)  # (as the thread's copies)
                try:
                    self.snapshots.append((source.clone(), buffer))
                except torch.cuda.OutOfMemoryError:
                    break
                most_taken += size
            for source, buffer in rest[len(self.snapshots) :]:  # no room: copied now
                source.record_stream(self.stream)
                buffer.copy_(source, non_blocking=True)
        # The update waits for all of it: the thread's copies in flight, the snapshots, the direct copies.
        torch.cuda.current_stream().wait_stream(self.stream)
        self.snapshot_bytes = sum(snapshot.nbytes for snapshot, _ in self.snapshots)
        return self.snapshot_bytes


def map_leaves(value, fn: Callable[[str, object], object], path: str = ""):
    """value with each leaf (what is not a dict, list or tuple) replaced by fn(its path, leaf); the
    paths ("/optimizer/state/3/exp_avg") name the buffers, in the training and writer processes."""
    if isinstance(value, dict):
        return {key: map_leaves(item, fn, f"{path}/{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_leaves(item, fn, f"{path}/{i}") for i, item in enumerate(value))
    return fn(path, value)


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """{path: local tensor} of every tensor in state."""
    found = {}

    def note(path: str, leaf) -> None:
        if isinstance(leaf, torch.Tensor):
            found[path] = leaf.to_local() if isinstance(leaf, DTensor) else leaf

    map_leaves(state, note)
    return found
