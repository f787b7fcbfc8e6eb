"""Token shards prepared by several processes (scripts/prepare_data.py), the same bytes for any number.

The corpus is cut into units, planned from the file list alone:
    a run of consecutive whole files (.txt, and .jsonl/.parquet files up to --unit-bytes),
    a byte range of a larger .jsonl file, cut where a line starts,
    a run of row groups of a larger .parquet file,
    a Hugging Face stream, whole (it cannot be cut: one unit, one process).
Workers tokenize units with training's own code (data.packing.tokenize, so token ids and errors are
training's) into <output>.partial/units/: each unit's tokens, its documents' lengths, and a record
of the input it read. The units are then joined in source order and cut into shards where one
process cuts them (after the first document that fills --shard-tokens): how the work was split
leaves no trace in the output.

Resume: <output>.partial/arguments.json records what the output depends on; a rerun with the same
arguments reuses every unit whose record still matches its input (path, size, mtime_ns, range) and
tokenizes the rest. A rerun with other arguments is refused; nothing is ever deleted but our own
cache, at the end, and a .partial folder this run created that holds no finished unit.

Longer than this repository's usual module: planning, workers, resume and joining share the unit
format and are read together.
"""

import fcntl
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from configs import UserError
from data.packing import tokenize
from data.shards import write_meta
from data.sources import TextFiles, build_document_source
from data.tokenizer import Tokenizer, build_tokenizer

PARTIAL_FORMAT = "prepare-data-partial-v1"
PROGRESS_SECONDS = 5.0  # at most one progress line this often
WRITE_TOKENS = 2**20  # a unit's tokens go to disk (and into the progress count) in pieces this big
COPY_BYTES = 2**24  # joining copies shards in pieces this big


@dataclass(frozen=True)
class Settings:
    """What the output depends on (recorded in <output>.partial); --workers and --unit-bytes are not."""

    dataset: str
    dataset_path: str
    text_field: str
    subset: str
    split: str
    hf_assets_path: str
    shard_tokens: int


@dataclass(frozen=True)
class Unit:
    kind: str  # "files", "jsonl" (a byte range), "parquet" (row groups) or "hf"
    files: tuple[tuple[str, int, int], ...]  # (path as found, size, mtime_ns) of each file it reads
    start: int = 0  # jsonl: offset of its first line; parquet: its first row group
    stop: int | None = None  # jsonl: offset past its last line; parquet: the row group after its last
    input_bytes: int = 0

    def fingerprint(self) -> list:
        files = [[str(Path(path).resolve()), size, mtime] for path, size, mtime in self.files]
        return [self.kind, files, self.start, self.stop]

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint()).encode()).hexdigest()[:24]


def plan_units(source, unit_bytes: int) -> list[Unit]:
    """The units of a document source (data/sources.py), in its order."""
    if not isinstance(source, TextFiles):
        return [Unit("hf", ())]
    units: list[Unit] = []
    group: list[tuple[str, int, int]] = []

    def close_group() -> None:
        if group:
            units.append(Unit("files", tuple(group), input_bytes=sum(size for _, size, _ in group)))
            group.clear()

    for path in source.files:
        stat = path.stat()
        entry = (str(path), stat.st_size, stat.st_mtime_ns)
        ranges = None
        if stat.st_size > unit_bytes and path.suffix == ".jsonl":
            ranges = _jsonl_ranges(path, stat.st_size, unit_bytes)
        elif stat.st_size > unit_bytes and path.suffix == ".parquet":
            ranges = _parquet_ranges(path, unit_bytes)
        if ranges is not None or sum(size for _, size, _ in group) + stat.st_size > unit_bytes:
            close_group()
        if ranges is None:
            group.append(entry)
        else:
            units += [Unit(path.suffix[1:], (entry,), start, stop, size) for start, stop, size in ranges]
    close_group()
    return units


def _jsonl_ranges(path: Path, size: int, unit_bytes: int) -> list[tuple[int, int, int]]:
    """(first byte, byte past the end, bytes) of pieces of about unit_bytes, each cut where a line starts."""
    ranges, start = [], 0
    with path.open("rb") as file:
        while start < size:
            file.seek(start + unit_bytes - 1)
            file.readline()  # to the end of the line that holds the piece's last byte
            stop = min(file.tell(), size)
            ranges.append((start, stop, stop - start))
            start = stop
    return ranges


def _parquet_ranges(path: Path, unit_bytes: int) -> list[tuple[int, int, int]] | None:
    """(first row group, row group past the last, compressed bytes) of runs of about unit_bytes;
    None if the file cannot be read: its unit's worker then says why, in data/sources.py's words."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError):
        return None
    ranges, first, size = [], 0, 0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        size += sum(row_group.column(c).total_compressed_size for c in range(row_group.num_columns))
        if size >= unit_bytes or group == metadata.num_row_groups - 1:
            ranges.append((first, group + 1, size))
            first, size = group + 1, 0
    return ranges or None


class UnitSource:
    """One unit's documents: a DocumentSource (data/sources.py) over the unit's files that ends
    where the unit ends. first_line numbers the first line of a .jsonl range, for error messages."""

    def __init__(self, unit: Unit, text_field: str, first_line: int = 1):
        self.files = TextFiles([Path(path) for path, _, _ in unit.files], text_field)
        starts = {"files": [0], "jsonl": [0, unit.start, first_line], "parquet": [0, unit.start, 0]}
        self.start = starts[unit.kind]  # a position of data/sources.py's TextFiles
        self.stop = unit.stop

    def documents(self, start: list[int] | None = None):
        for position, text in self.files.documents(start or self.start):
            # The next unit's first document was read once to see this; it is read again there.
            if self.stop is not None and position[1] >= self.stop:
                return
            yield position, text

    def where(self, position: list[int]) -> str:
        return self.files.where(position)


@dataclass(frozen=True)
class Job:
    """What a worker needs besides its units."""

    settings: Settings
    folder: Path  # <output>.partial/units
    dtype: str
    text_field: str  # the source's (python_docs has its own)


def tokenize_unit(unit: Unit, job: Job, tokenizer: Tokenizer, on_tokens: Callable[[int], None]) -> None:
    """Writes the unit's tokens, lengths and record to job.folder; a bad input raises its UserError."""
    try:
        _tokenize_unit(unit, job, tokenizer, on_tokens, first_line=1)
    except UserError:
        if unit.kind != "jsonl" or unit.start == 0:
            raise
        # Lines were counted from this unit's start: count those before it (only now, on an error)
        # and read again, so that the error names the file's own line number.
        first_line = 1 + _count_newlines(Path(unit.files[0][0]), unit.start)
        _tokenize_unit(unit, job, tokenizer, lambda count: None, first_line)
        raise


def _tokenize_unit(unit: Unit, job: Job, tokenizer: Tokenizer, on_tokens, first_line: int) -> None:
    settings = job.settings
    if unit.kind == "hf":
        source = build_document_source("hf", settings.dataset_path, settings.text_field, settings.subset,
                                       settings.split)  # fmt: skip
        start = None  # the whole corpus: tokenize() refuses one without text
    else:
        source = UnitSource(unit, job.text_field, first_line)
        start = source.start  # from a position: a unit of empty documents is fine (see prepare)
    temporary = f".{os.getpid()}.tmp"  # a worker left over from a killed run may write the same unit
    tokens_path, lengths_path = job.folder / f"{unit.key}.tokens", job.folder / f"{unit.key}.lengths.npy"
    lengths, with_text, pending, pending_tokens = [], 0, [], 0
    with open(str(tokens_path) + temporary, "wb") as out:
        for _, tokens in tokenize(source, tokenizer, start):
            lengths.append(len(tokens))
            with_text += len(tokens) > 1
            pending.append(tokens)
            pending_tokens += len(tokens)
            if pending_tokens >= WRITE_TOKENS:
                np.concatenate(pending).astype(job.dtype).tofile(out)
                on_tokens(pending_tokens)
                pending, pending_tokens = [], 0
        if pending:
            np.concatenate(pending).astype(job.dtype).tofile(out)
            on_tokens(pending_tokens)
    with open(str(lengths_path) + temporary, "wb") as out:
        np.save(out, np.asarray(lengths, dtype=np.int64))
    os.replace(str(tokens_path) + temporary, tokens_path)
    os.replace(str(lengths_path) + temporary, lengths_path)
    record = {"fingerprint": unit.fingerprint(), "documents": len(lengths), "documents_with_text": with_text,
              "tokens": int(sum(lengths))}  # fmt: skip
    _write_atomically(job.folder / f"{unit.key}.json", json.dumps(record) + "\n")  # last: the unit is done


def _count_newlines(path: Path, stop: int) -> int:
    count = 0
    with path.open("rb") as file:
        while file.tell() < stop:
            count += file.read(min(COPY_BYTES, stop - file.tell())).count(b"\n")
    return count


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def finished_record(unit: Unit, folder: Path, itemsize: int) -> dict | None:
    """The record of a unit finished earlier on the same input, or None."""
    try:
        record = json.loads((folder / f"{unit.key}.json").read_text())
        tokens_bytes = (folder / f"{unit.key}.tokens").stat().st_size
        (folder / f"{unit.key}.lengths.npy").stat()
    except (OSError, ValueError):
        return None
    if record.get("fingerprint") != unit.fingerprint() or tokens_bytes != record["tokens"] * itemsize:
        return None
    return record


class Progress:
    """One line at most every PROGRESS_SECONDS: units done, tokens, tokens/s of this run, ETA."""

    def __init__(self, units: list[Unit], reused: list[Unit], reused_tokens: int):
        self.total_units, self.done_units = len(units), len(reused)
        self.left_bytes = sum(u.input_bytes for u in units) - sum(u.input_bytes for u in reused)
        self.run_bytes = 0  # input of the units this run finished
        self.reused_tokens = reused_tokens
        self.started = self.printed = time.monotonic()

    def unit_done(self, unit: Unit) -> None:
        self.done_units += 1
        self.run_bytes += unit.input_bytes
        self.left_bytes -= unit.input_bytes

    def report(self, run_tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.printed < PROGRESS_SECONDS:
            return
        self.printed = now
        elapsed = max(now - self.started, 1e-9)
        eta = "0s" if final else "--"
        if self.run_bytes and not final:
            eta = _duration(self.left_bytes * elapsed / self.run_bytes)
        print(f"units {self.done_units}/{self.total_units}, {self.reused_tokens + run_tokens:,} tokens, "
              f"{run_tokens / elapsed:,.0f} tokens/s, ETA {eta}", flush=True)  # fmt: skip


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def tokenize_here(units: list[Unit], job: Job, tokenizer: Tokenizer, progress: Progress) -> None:
    """One process: the units in order, the tokenizer's thread pool on every core."""
    run_tokens = 0

    def counted(count: int) -> None:
        nonlocal run_tokens
        run_tokens += count
        progress.report(run_tokens)

    for unit in units:
        tokenize_unit(unit, job, tokenizer, counted)
        progress.unit_done(unit)
    progress.report(run_tokens, final=True)


def tokenize_in_workers(units: list[Unit], job: Job, workers: int, progress: Progress) -> None:
    """`workers` spawned processes take units in order; the first error stops them all."""
    context = multiprocessing.get_context("spawn")  # no fork: no copied locks or tokenizer threads
    tasks, results, counter = context.Queue(), context.Queue(), context.Value("q", 0)
    for unit in units:
        tasks.put(unit)
    for _ in range(workers):
        tasks.put(None)
    # A Hugging Face tokenizer spreads each batch over a thread pool of every core; N workers would
    # run N such pools. Each worker gets its share of the cores (RAYON_NUM_THREADS; with one thread,
    # TOKENIZERS_PARALLELISM=false skips the pool), unless the user set these variables.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    processes = [context.Process(target=_worker, args=(job, tasks, results, counter, threads, os.getpid()),
                                 daemon=True) for _ in range(workers)]  # fmt: skip
    for process in processes:
        process.start()
    try:
        for _ in units:
            while True:
                try:
                    unit, error = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    _check_alive(processes)
                    progress.report(counter.value)
            if error is not None:
                raise error
            progress.unit_done(unit)
            progress.report(counter.value)
        progress.report(counter.value, final=True)
    finally:
        tasks.cancel_join_thread()  # units never taken must not keep this process from exiting
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()


def _check_alive(processes: list) -> None:
    dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
    if dead:  # a crash (its traceback is above) or the kernel's OOM killer (-9): not a user error
        raise RuntimeError(f"a preparation worker stopped unexpectedly (exit code {dead[0]})")


def _worker(job: Job, tasks, results, counter, threads: int, parent: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process: the parent stops us
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    if threads == 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def counted(count: int) -> None:
        with counter.get_lock():
            counter.value += count

    try:
        tokenizer = build_tokenizer(job.settings.hf_assets_path)
        while (unit := _next_task(tasks, parent)) is not None:
            tokenize_unit(unit, job, tokenizer, counted)
            results.put((unit, None))
    except UserError as error:
        results.put((None, error))


def _next_task(tasks, parent: int) -> Unit | None:
    """The next unit; None when there are no more, or the parent is gone (killed with SIGKILL)."""
    while os.getppid() == parent:
        try:
            return tasks.get(timeout=5.0)
        except queue.Empty:
            continue
    return None


def join_units(units: list[Unit], folder: Path, partial: Path, dtype: np.dtype, shard_tokens: int) -> list:
    """Concatenates the units' tokens in order into shards of whole documents, each cut after the
    first document that brings it to shard_tokens or more (as one process writing them cuts)."""
    shards: list[dict] = []
    itemsize = np.dtype(dtype).itemsize
    out, in_shard = None, 0  # the shard being written and its tokens so far

    def copy(tokens_file, count: int) -> None:
        nonlocal out, in_shard
        if count and out is None:
            out = open(partial / f"tokens-{len(shards):05d}.bin", "wb")
        left = count * itemsize
        while left:
            piece = tokens_file.read(min(COPY_BYTES, left))
            out.write(piece)
            left -= len(piece)
        in_shard += count

    def close_shard() -> None:
        nonlocal out, in_shard
        out.close()
        name = f"tokens-{len(shards):05d}.bin"
        shards.append({"file": name, "num_tokens": in_shard})
        print(f"wrote {name}: {in_shard:,} tokens", flush=True)
        out, in_shard = None, 0

    for unit in units:
        ends = np.cumsum(np.load(folder / f"{unit.key}.lengths.npy"))  # where each document ends
        done = 0  # the unit's tokens already copied
        with open(folder / f"{unit.key}.tokens", "rb") as tokens_file:
            while True:
                # The first document that fills the shard: in_shard + (its end - done) >= shard_tokens.
                filling = int(np.searchsorted(ends, shard_tokens - in_shard + done))
                if filling == len(ends):
                    break
                copy(tokens_file, int(ends[filling]) - done)
                close_shard()
                done = int(ends[filling])
            copy(tokens_file, (int(ends[-1]) if len(ends) else 0) - done)
    if in_shard:
        close_shard()
    return shards


def open_partial(partial: Path, arguments: dict) -> tuple[bool, object]:
    """Creates <output>.partial with its arguments, or checks an existing one's against these.
    Returns (created now, the open lock file that keeps a second run out until this one ends)."""
    record = partial / "arguments.json"
    created = not partial.exists()
    if created:
        (partial / "units").mkdir(parents=True)
        _write_atomically(record, json.dumps(arguments, indent=1) + "\n")
    elif not record.is_file():
        raise UserError(
            f"'{partial}' exists but records no arguments (left by an older prepare_data.py?); "
            f"delete '{partial}' to start over"
        )
    else:
        recorded = json.loads(record.read_text())
        differences = [f"{name} {recorded.get(name)!r} (now {value!r})"
                       for name, value in arguments.items() if recorded.get(name) != value]  # fmt: skip
        if differences:
            raise UserError(
                f"'{partial}' holds an unfinished preparation made with other arguments: "
                f"{', '.join(differences)}; rerun with its arguments to finish it, or delete '{partial}' "
                "to start over"
            )
        (partial / "units").mkdir(exist_ok=True)
    lock = open(partial / "lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(f"another prepare_data.py is writing '{partial}'; wait for it to end") from None
    return created, lock


def prepare(settings: Settings, output: Path, workers: int, unit_bytes: int) -> None:
    if output.exists():
        raise UserError(f"--output '{output}' already exists; choose a new folder")
    tokenizer = build_tokenizer(settings.hf_assets_path)
    source = build_document_source(settings.dataset, settings.dataset_path, settings.text_field,
                                   settings.subset, settings.split)  # fmt: skip
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    units = plan_units(source, unit_bytes)
    partial = output.with_name(output.name + ".partial")
    flags = {"--" + name.replace("_", "-"): value for name, value in asdict(settings).items()}
    arguments = {"format": PARTIAL_FORMAT, **flags, "tokenizer identity": tokenizer.identity}
    created, lock = open_partial(partial, arguments)
    text_field = source.text_field if isinstance(source, TextFiles) else settings.text_field
    job = Job(settings, partial / "units", dtype.name, text_field)
    records = {unit.key: finished_record(unit, job.folder, dtype.itemsize) for unit in units}
    reused = [unit for unit in units if records[unit.key] is not None]
    left = [unit for unit in units if records[unit.key] is None]
    plural = "s" * (len(units) != 1)
    print(f"{len(units)} unit{plural}, {len(reused)} reused from an earlier run in {partial}", flush=True)
    if units[0].kind == "hf" and workers > 1:
        print("the hf stream is one unit, read by one process: --workers does not speed it up", flush=True)
    progress = Progress(units, reused, sum(records[u.key]["tokens"] for u in reused))
    try:
        if min(workers, len(left)) > 1:
            tokenize_in_workers(left, job, min(workers, len(left)), progress)
        else:
            tokenize_here(left, job, tokenizer, progress)
    except (UserError, KeyboardInterrupt) as stop:
        kept = sum(finished_record(unit, job.folder, dtype.itemsize) is not None for unit in units)
        lock.close()
        if created and not kept:
            shutil.rmtree(partial)  # made by this run, holds nothing
        if isinstance(stop, KeyboardInterrupt):
            where = f"are kept in {partial}; run the same command again to continue" if kept else "kept"
            print(f"interrupted: {kept} of {len(units)} units {where}", file=sys.stderr)
        raise
    records = {unit.key: finished_record(unit, job.folder, dtype.itemsize) for unit in units}
    if not any(record["documents_with_text"] for record in records.values()):
        for _ in tokenize(source, tokenizer):  # it refuses a corpus without text, in training's words
            pass
    shards = join_units(units, job.folder, partial, dtype, settings.shard_tokens)
    tokenizer_name = settings.hf_assets_path or "byte"
    write_meta(partial, dtype.name, tokenizer.vocab_size, tokenizer.eos_id, tokenizer_name,
               tokenizer.identity, shards)  # fmt: skip
    shutil.rmtree(job.folder)  # our cache; the folder then holds what one process would have written
    (partial / "arguments.json").unlink()
    (partial / "lock").unlink()
    lock.close()
    partial.rename(output)
    documents = sum(record["documents"] for record in records.values())
    total = sum(shard["num_tokens"] for shard in shards)
    files = f"{len(shards)} shard{'s' * (len(shards) != 1)}"
    print(f"{documents:,} documents, {total:,} tokens in {files} -> {output}")
