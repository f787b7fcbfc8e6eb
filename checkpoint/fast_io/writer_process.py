"""The process that writes async saves, so that training keeps its speed meanwhile.

Writing a save is Python-heavy (DCP plans and serializes record by record). In a thread of the
training process that work holds the GIL, which the training thread retakes at every kernel
launch: on the H200, the steps while a thread wrote a 1B save ran at 41-54% of their speed
(docs/checkpointing.md). Here each rank has one writer process for the run (started with it, so that
it has imported torch by the first save; given the host buffers once they exist, after the first
optimizer step), which maps the buffers of the staged state (checkpoint/fast_io/staging.HostArena) and
runs the same DCP save with the same storage writer and planner as a blocking save. Per save the
training process sends only the state's structure with each tensor named by its place in the
arena; the writer answers with its files' checksums (or what went wrong), and the training process
commits the save as before. With several ranks the writers plan together in their own gloo group
(on the run's rendezvous store, under a prefix of their own).

The writer dies with its training process (PR_SET_PDEATHSIG): a killed run leaves only a
`.partial` folder, never loaded. It does not use the GPU (CUDA_VISIBLE_DEVICES is empty there). A
writer that dies first (killed, out of memory) is replaced by a thread of the training process
(checkpoint/fast_io/__init__.py); one that stops (SIGSTOP, stuck) is given up at the bound of
checkpoint/background.py and killed.
"""

import ctypes
import dataclasses
import gc
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from checkpoint.fast_io.staging import Stager, arena_view, map_leaves

logger = logging.getLogger(__name__)
REPOSITORY = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class InArena:
    """A tensor of the staged state, as the writer finds it: its bytes in the arena and, for a
    DTensor's local shard, where the shard lies in the whole tensor."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    whole: tuple[int, ...] | None = None  # a shard's whole tensor's shape
    shard_offsets: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ByValue:
    """A tensor of the staged state outside the arena (e.g. optimizer state that a parameter first
    got after the buffers were made), sent with the request; for a DTensor its local shard."""

    tensor: torch.Tensor
    whole: tuple[int, ...] | None = None
    shard_offsets: tuple[int, ...] | None = None


def describe_staged(stager: Stager, state: dict) -> dict:
    """The staged state with each tensor replaced by an InArena (or, outside the arena, ByValue);
    other values as they are."""

    def describe(path: str, value):
        if not isinstance(value, torch.Tensor):
            return value
        local = value._local_tensor if isinstance(value, DTensor) else value
        shard = {}
        if isinstance(value, DTensor):
            (chunk,) = value.__create_chunk_list__()  # this rank's piece: one chunk
            shard = {"whole": tuple(value.shape), "shard_offsets": tuple(chunk.offsets)}
        if not stager.in_arena(path, local):
            return ByValue(local, **shard)
        return InArena(stager.offsets[path], tuple(local.shape), local.dtype, **shard)

    return map_leaves(state, describe)


class Shard(torch.Tensor):
    """A rank's piece of a larger tensor, saved by DCP as it saves a DTensor's local shard (DCP
    asks any tensor that has these methods for its write items and chunks)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results of ops: plain tensors

    @staticmethod
    def of(local: torch.Tensor, whole: tuple[int, ...], offsets: tuple[int, ...]) -> "Shard":
        shard = torch.Tensor._make_subclass(Shard, local)
        shard.whole, shard.chunk = torch.Size(whole), ChunkStorageMetadata(torch.Size(offsets), local.shape)
        return shard

    def __create_write_items__(self, fqn: str, object) -> list[WriteItem]:
        data = TensorWriteData(self.chunk, TensorProperties.create_from_tensor(self), self.whole)
        return [WriteItem(MetadataIndex(fqn, self.chunk.offsets), WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self


class WriterProcess:
    """The training process's end: start the writer (at the start of the run, so that it has
    imported torch by the first save), give it the arena once it exists, hand it saves."""

    def __init__(self, rank: int, world_size: int, group_prefix: str):
        ours, theirs = socket.socketpair()
        self.connection = Connection(ours.detach())
        # (Not `-m checkpoint.fast_io.writer_process`: its package imports this module first, and
        # runpy then prints a RuntimeWarning on the run's stderr.)
        command = [sys.executable, "-c", "from checkpoint.fast_io.writer_process import serve; serve()",
                   str(theirs.fileno()), str(os.getpid()), group_prefix]  # fmt: skip
        environment = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            CUDA_VISIBLE_DEVICES="",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
        )
        self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), env=environment)
        theirs.close()
        self.ready = False

    def wait_until_ready(self) -> str | None:
        """Before the first write: wait until the writer has started (imported torch, joined the
        other ranks' writers); what went wrong, if it did not. (In the background: a save early in
        a run does not block training for it: 1.6-2.8 s measured for a save at step 10 on the
        H200.)"""
        if not self.ready:
            try:
                self.ready = self.connection.recv() == "ready"
            except (EOFError, OSError):
                return f"the checkpoint writer process ended ({self._end()})"
        return None

    def attach(self, arena_fd: int) -> None:
        """Share the arena (its file descriptor passed over the socket). A writer that is gone
        fails the next save instead, with its exit code."""
        try:
            self.connection.send("arena")
            reduction.send_handle(self.connection, arena_fd, self.process.pid)
        except OSError:
            pass

    def write(self, described_state: dict, partial: Path, writer_threads: int, direct_io: bool):
        """(this rank's files' checksums or what went wrong, seconds spent checksumming)."""
        not_started = self.wait_until_ready()
        if not_started:
            return not_started, 0.0
        try:
            self.connection.send_bytes(encode_request(described_state, partial, writer_threads, direct_io))
            return self.connection.recv()
        except (EOFError, OSError):
            return f"the checkpoint writer process ended ({self._end()})", 0.0

    def ended(self) -> str | None:
        """How the writer ended ("killed by SIGKILL", "exit code 1"); None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        if code == -signal.SIGKILL:
            return "killed by SIGKILL: out of memory, or kill -9"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        """End the writer now, whatever it is doing (stopped too); its save then fails."""
        self.process.kill()
        self._end()

    def _end(self) -> str:
        """How the writer ended, once it has (its connection closed: it is ending)."""
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # (stuck in the kernel: a kill takes effect when it leaves)
            return "not ended yet"
        return self.ended()

    def close(self) -> None:
        try:
            self.connection.send(None)
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.connection.close()


def encode_request(described_state: dict, partial: Path, writer_threads: int, direct_io: bool) -> bytes:
    """A write request in plain pickle: its ByValue tensors go by value. (Connection.send's pickler
    would pass their storage as a file descriptor, which a writer started by Popen, not by
    multiprocessing, refuses: "digest sent was rejected".)"""
    return pickle.dumps((described_state, str(partial), writer_threads, direct_io))


def _die_with_parent(parent: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        sys.exit(1)


def _join_writer_group(prefix: str) -> None:
    """The writers of all ranks in one gloo group, on the store the training processes met on
    (alone: a group of one, as train.py makes for one process)."""
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size)


def _rebuild(arena: torch.Tensor, described_state: dict) -> dict:
    """The state describe_staged described, its tensors in this process's map of the arena."""

    def rebuild(path: str, value):
        if isinstance(value, ByValue):
            tensor = value.tensor
        elif isinstance(value, InArena):
            tensor = arena_view(arena, value.offset, value.shape, value.dtype)
        else:
            return value
        return tensor if value.whole is None else Shard.of(tensor, value.whole, value.shard_offsets)

    return map_leaves(described_state, rebuild)


def _receive(connection: Connection):
    """The next request; None when told to stop or when the training process is gone."""
    try:
        return connection.recv()
    except (EOFError, OSError):
        return None


def main(connection_fd: int, parent: int, group_prefix: str) -> None:
    import mmap

    from checkpoint.fast_io.writing import write_files

    _die_with_parent(parent)
    connection = Connection(connection_fd)
    arena = None
    _join_writer_group(group_prefix)
    connection.send("ready")
    while (request := _receive(connection)) is not None:
        if request == "arena":
            arena_fd = reduction.recv_handle(connection)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # (mapped at once, not page by page)
            mapped = mmap.mmap(arena_fd, os.fstat(arena_fd).st_size, flags=flags)
            arena = torch.frombuffer(mapped, dtype=torch.uint8)
            continue
        described_state, partial, writer_threads, direct_io = request
        try:
            state = _rebuild(arena, described_state)
            reply = write_files(state, Path(partial), int(os.environ["RANK"]), writer_threads, direct_io)
        except Exception as e:  # (write_files reports write errors itself)
            reply = (f"the checkpoint writer failed: {type(e).__name__}: {e}", 0.0)
        connection.send(reply)


def serve() -> None:
    """The writer process's entry (python -c, arguments: the socket, the parent's pid, the prefix of
    the writers' group); this module imported under its own name, as the parent's InArena values
    unpickle."""
    logging.basicConfig(level=logging.WARNING)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    gc.freeze()  # exit without walking every object for cycles (~1 s with torch loaded; train.py alike)
