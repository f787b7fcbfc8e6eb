"""DCP's writer with each rank's data files written past the page cache and checksummed on the way,
and its reader with a rank's files read in parallel.

DCP's FileSystemWriter writes through Python file objects: every byte is copied into the page
cache, written back by the kernel and fsync'ed at the end (on the H200 machine a save of host
tensors ran at 1.54 GB/s that way, 1.87 with O_DIRECT, 4 threads; benchmarks/benchmark_checkpoint_stages.py),
and the checksums then read the files back. Here the data
files (*.distcp) go through `DataFile`: bytes are gathered into one page-aligned 64 MiB buffer,
the buffer's CRC32 is taken (the piece checksums.json records, checkpoint/integrity.py, so the
files need not be read back), and the buffer is written with O_DIRECT: no page-cache copy, no
write-back at fsync. Where a filesystem refuses O_DIRECT (tmpfs, some network filesystems) or the
platform has none, the same buffers are written the ordinary way and fsync'ed at close.

DCP's FileSystemReader reads a rank's share one file after another and one tensor after another in
the calling thread (torch.load of each record, then a copy to the tensor's device). ParallelReader
reads them in parallel threads, each thread a run of records in file order (torch.load's reads and
the copies release the GIL); it is a DataOnlyReader (checkpoint/data_only.py): nothing it reads is
unpickled as anything but data.
"""

import dataclasses
import errno
import fcntl
import mmap
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from checkpoint.data_only import DataOnlyReader, read_file_by_file
from checkpoint.integrity import PIECE_BYTES

SMALL_WRITE = 64 * 1024  # bytes; larger writes are copied by numpy, without the GIL
ALIGNMENT = 4096  # O_DIRECT offsets and lengths: a multiple of the device's block size (<= 4 KiB)
O_DIRECT = getattr(os, "O_DIRECT", 0)  # (none on macOS)


class DataFile:
    """A write-only file object (write, tell, flush, fileno, close, name) that writes whole pieces
    of PIECE_BYTES (the last one padded, then truncated) and keeps each piece's CRC32."""

    def __init__(self, path: Path, direct: bool):
        self.name = str(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self.direct = direct and O_DIRECT != 0
        try:
            self.fd = os.open(path, flags | (O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise OSError(e.errno, e.strerror, self.name) from None
            self.direct = False  # the filesystem refuses O_DIRECT at open (tmpfs)
            self.fd = os.open(path, flags, 0o644)
        # Page-aligned, as O_DIRECT needs; written through numpy, whose copies free the GIL.
        self.array = numpy.frombuffer(mmap.mmap(-1, PIECE_BYTES), dtype=numpy.uint8)
        self.view = memoryview(self.array)  # (small writes)
        self.filled = 0  # bytes in the buffer
        self.position = 0  # bytes written by the caller
        self.crc32: list[str] = []  # one per piece written
        self.closed = False

    def write(self, data) -> int:
        given = memoryview(data)
        size = given.nbytes
        if size <= SMALL_WRITE and self.filled + size < PIECE_BYTES:
            # Record headers and pickles (~11 calls per record): a slice assignment costs less
            # than numpy's per-call setup, and holding the GIL for a few KB does not matter.
            self.view[self.filled : self.filled + size] = given.cast("B")
            self.filled += size
            self.position += size
            return size
        # numpy copies without holding the GIL (a memoryview slice assignment holds it): an async
        # save's writer threads then do not stall the training thread (measured on the H200).
        data = numpy.frombuffer(data, dtype=numpy.uint8)
        done = 0
        while done < len(data):
            take = min(PIECE_BYTES - self.filled, len(data) - done)
            numpy.copyto(self.array[self.filled : self.filled + take], data[done : done + take])
            self.filled, done = self.filled + take, done + take
            if self.filled == PIECE_BYTES:
                self._write_piece()
        self.position += done
        return done

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        """Nothing: a piece is written when full (called after every record DCP writes)."""

    def fileno(self) -> int:
        return self.fd

    def writable(self) -> bool:
        return True

    def summary(self) -> dict:
        """This file's entry in checksums.json."""
        return {"size": self.position, "crc32": self.crc32 or [f"{zlib.crc32(b''):08x}"]}

    def close(self, failed: bool = False) -> None:
        """Write the last piece and fsync (failed: only release the file, the save is lost)."""
        if self.closed:
            return
        self.closed = True
        try:
            if failed:
                return
            if self.filled:
                self._write_piece()
                if self.direct:
                    os.ftruncate(self.fd, self.position)  # the last piece's padding
            os.fsync(self.fd)  # (DCP's own fsync comes before close, i.e. before the last piece)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.name) from None
        finally:
            os.close(self.fd)
            self.view.release()
            self.array = self.view = None  # (the buffer is freed with the last view of it)

    def __enter__(self):
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(failed=kind is not None)

    def _write_piece(self) -> None:
        size = self.filled
        self.crc32.append(f"{zlib.crc32(self.array[:size]):08x}")  # (zlib releases the GIL)
        length = -(-size // ALIGNMENT) * ALIGNMENT if self.direct else size
        self.array[size:length] = 0
        written = 0
        try:
            while written < length:
                try:
                    written += os.write(self.fd, self.array[written:length])
                except OSError as e:
                    if not (self.direct and e.errno == errno.EINVAL and written == 0):
                        raise
                    # The filesystem accepted O_DIRECT at open but refuses the write: write through
                    # the page cache from here on (nothing of this piece is written yet).
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
                    self.direct, length = False, size
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.name) from None
        self.filled = 0


class ChecksummedFiles(FileSystem):
    """DCP's local filesystem, with data files opened as DataFile; `checksums` collects their
    checksums.json entries by file name (written from DCP's writer threads)."""

    def __init__(self, direct: bool):
        self.direct = direct
        self.checksums: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        path = Path(path)
        if mode != "wb" or path.suffix != ".distcp":  # .metadata and reads: as DCP does
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with DataFile(path, self.direct) as stream:
            yield stream
        self.checksums[path.name] = stream.summary()


def storage_writer(folder: Path, threads: int, direct: bool) -> FileSystemWriter:
    """DCP's FileSystemWriter into folder through ChecksummedFiles (writer.fs.checksums)."""
    writer = FileSystemWriter(str(folder), thread_count=threads)
    writer.fs = ChecksummedFiles(direct)
    return writer


class ParallelReader(DataOnlyReader):
    """DataOnlyReader reading its plan's records in `threads` parallel threads: the records in
    file order, cut into runs of about equal bytes, one run per thread (so that one large file, as
    a conversion script writes, or the few files a rank reads after a layout change, are read in
    parallel too)."""

    def __init__(self, folder: Path, threads: int):
        super().__init__(folder)
        self.threads = threads
        self.timings: dict[str, float] = {}  # seconds of read_data's parts, for the resume's log line

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        # Byte records (train state, data cursor, the optimizer's hyperparameters) change the state
        # dict's structure: read them here, as data only (DataOnlyReader). Tensors (DCP's reader
        # loads them with weights_only=True) are copied into tensors that exist already, each by
        # one thread.
        start = time.perf_counter()
        byte_records = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        super().read_data(dataclasses.replace(plan, items=byte_records), planner)
        self.timings["byte records"] = time.perf_counter() - start
        where = lambda item: (self.storage_data[item.storage_index].relative_path,
                              self.storage_data[item.storage_index].offset)  # fmt: skip
        tensors = sorted((item for item in plan.items if item.type != LoadItemType.BYTE_IO), key=where)
        sizes = [self.storage_data[item.storage_index].length for item in tensors]
        runs = [dataclasses.replace(plan, items=run) for run in equal_runs(tensors, sizes, self.threads)]
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, len(runs))) as pool:
            read = lambda part: FileSystemReader.read_data(self, part, planner)
            for done in [pool.submit(read_file_by_file, self, run, read) for run in runs]:
                done.result()  # (raises the first failure, naming its file)
        self.timings["tensors"] = time.perf_counter() - start
        finished = Future()
        finished.set_result(None)
        return finished


def equal_runs(items: list, sizes: list[int], count: int) -> list[list]:
    """items cut, in order, into at most `count` non-empty runs of about equal total size."""
    total, runs, done = sum(sizes), [], 0
    for item, size in zip(items, sizes):
        if not runs or (done >= total * len(runs) / count and len(runs) < count):
            runs.append([])
        runs[-1].append(item)
        done += size
    return runs
