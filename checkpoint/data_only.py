"""Reading a checkpoint as data only: nothing in its files can make this process run code.

A DCP checkpoint holds pickles, and a plain unpickler calls whatever a pickle names: torch's reader
unpickles `.metadata` with pickle.load, and DCP's load planner reads the byte records (the values
that are not tensors: step, data cursor, RNG state, the optimizer's settings) with
torch.load(weights_only=False). A checkpoint from someone else, or one rewritten with its checksums
recomputed, could run a command at the next resume. So every read of a checkpoint goes through here:

- `.metadata` is read into memory, checked against checksums.json (if the checkpoint has one), and
  those same bytes unpickled by an unpickler that builds only the classes DCP's metadata is made of
  (METADATA_CLASSES, and torch's dtypes);
- byte records are read with torch.load(weights_only=True): builtins only (ours are ints, floats,
  bools, strings, bytes, tuples, lists, dicts; no class needs allowing). DataOnlyReader, the DCP
  reader of every load (checkpoint/storage.py, checkpoint/fast_io/), reads .metadata and byte
  records these two ways;
- pickles inside a value (the RNG state, checkpoint/state.py) go through plain_loads: no class at all.
Anything else is refused: one `error:` line names the checkpoint and what was refused, and nothing
of it was built. What this does not protect against: docs/checkpointing.md, "Trust model".
"""

import dataclasses
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # (what DefaultLoadPlanner uses)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from checkpoint import integrity
from configs import UserError
from configs.errors import first_line

# The classes DCP's .metadata is built from, and nothing else. Found by saving every kind of
# checkpoint this repository writes (plain DCP and fast_io; blocking, async by the writer process
# and by a thread, plain DCP async; a model-only bfloat16 export; scripts/convert_hf_to_dcp.py's;
# one process, FSDP 2, HSDP 2, TP 2, PP 2, EP 2 of DeepSeek-V3 and of Qwen3-MoE; AdamW and Muon)
# with torch 2.13 and unpickling each .metadata with an Unpickler that recorded every find_class it
# was asked for: these 12, and torch.float32 and torch.bfloat16 (every torch dtype is allowed).
# The slow tests of tests/test_checkpoint.py resume these kinds through here: a torch version that
# pickles another class fails there first.
METADATA_CLASSES = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # (an Enum)
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ]
)


class NotData(Exception):
    """A pickle names something a checkpoint never holds: `found` (module.name), in `where`."""

    def __init__(self, found: str, where: str):
        super().__init__(found, where)
        self.found, self.where = found, where


def refused(checkpoint, error: NotData) -> UserError:
    """The error line of a checkpoint that holds what `error` found."""
    return UserError(
        f"checkpoint {checkpoint} holds a pickled object of a kind a checkpoint never holds "
        f"({error.found} in {error.where}); it was not loaded"
    )


def not_data_in(failure: BaseException) -> NotData | None:
    """The refusal behind a failed dcp.load, if that is what failed it (DCP wraps each rank's error
    in a CheckpointException, as an exception or an (exception, traceback) pair)."""
    failures = getattr(failure, "failures", None) or {}
    for error in [failure, *failures.values()]:
        error = error[0] if isinstance(error, tuple) else error
        if isinstance(error, NotData):
            return error
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]  # a value (torch.float32), not something to call
        raise NotData(f"{module}.{name}", ".metadata")


class _PlainUnpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, where: str):
        super().__init__(io.BytesIO(raw))
        self.where = where

    def find_class(self, module: str, name: str):
        raise NotData(f"{module}.{name}", self.where)


def read_metadata(folder: Path, hint: str = "") -> Metadata:
    """A checkpoint's .metadata: its bytes checked against checksums.json (when the checkpoint has
    one), then unpickled as DCP's metadata and nothing else. hint: how to resume from an earlier
    checkpoint, for the error line of a damaged one."""
    try:
        raw = (folder / ".metadata").read_bytes()
    except OSError as e:
        raise UserError(f"checkpoint {folder} could not be read: .metadata: {e.strerror}{hint}") from None
    manifest = integrity.read_manifest(folder)
    if manifest is not None and (problem := integrity.problem_in(manifest, ".metadata", raw)):
        raise UserError(f"checkpoint {folder} is damaged: {problem}; it was not used{hint}")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except NotData as e:
        raise refused(folder, e) from None
    except Exception as e:
        raise UserError(
            f"checkpoint {folder} is corrupt: its .metadata cannot be read ({first_line(e)}); it was not "
            f"used{hint}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise UserError(
            f"checkpoint {folder} is corrupt: its .metadata holds a {type(metadata).__name__}; it was not "
            f"used{hint}"
        )
    return metadata


class UnreadableFile(Exception):
    """A checkpoint file that could not be read, named, with the cause (DCP's error names neither:
    "CheckpointException ranks:dict_keys([0])")."""

    def __init__(self, name: str, why: str):
        super().__init__(name, why)  # (plain arguments: DCP pickles a rank's failure to the others)

    def __str__(self) -> str:
        return f"{self.args[0]}: {self.args[1]}"


def _why(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if isinstance(error, EOFError):  # (torch.load past the end of a cut file: no message)
        return "it ends before its records do (truncated?)"
    if isinstance(error, pickle.UnpicklingError):  # (torch's message advises weights_only=False: no)
        return "a record in it cannot be unpickled (damaged?)"
    return f"{type(error).__name__}: {first_line(error)}"


def read_file_by_file(reader: FileSystemReader, plan: LoadPlan, read: Callable[[LoadPlan], object]) -> None:
    """read(the plan's items of one file) for each file the plan reads, in the plan's order; a
    failure is an UnreadableFile naming the file (a refusal, NotData, stays as it is)."""
    per_file: dict[str, list[ReadItem]] = {}
    for item in plan.items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    for name, items in per_file.items():
        try:
            read(dataclasses.replace(plan, items=items))
        except NotData:
            raise
        except Exception as e:
            raise UnreadableFile(name, _why(e)) from e


def load_record(stream: io.BytesIO, where: str) -> Any:
    """A byte record's value (torch.save's format), builtins only."""
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError:
        stream.seek(0)
        try:  # (reads the pickle's opcodes; builds nothing)
            found = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
        except Exception:
            found = []
        if not found:
            raise  # damaged, not refused
        raise NotData(", ".join(found), where) from None


def plain_loads(raw: bytes, where: str) -> Any:
    """A pickle of builtins only (dicts, lists, strings, bytes, numbers): any class is refused."""
    return _PlainUnpickler(raw, where).load()


class DataOnlyReader(FileSystemReader):
    """DCP's FileSystemReader with .metadata read by read_metadata above and the byte records by
    load_record, whatever load planner dcp.load is given (DCP's own stores what they hold)."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))

    # (Without the `rank` keyword of DCP's signature: DCP then never falls back to reading
    # per-rank metadata files, which this repository does not write, after a refusal.)
    def read_metadata(self) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # (as FileSystemReader does)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        as_data = _ByteRecordsAsData(planner)
        read_file_by_file(self, plan, lambda part: FileSystemReader.read_data(self, part, as_data))
        finished = Future()
        finished.set_result(None)
        return finished


class _ByteRecordsAsData:
    """A load planner as DCP's reader uses it, its byte records read by load_record and stored as
    DefaultLoadPlanner stores them (its own load_bytes unpickles with weights_only=False); the rest
    is the planner's own."""

    def __init__(self, planner: LoadPlanner):
        if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
            raise TypeError(
                f"{type(planner).__name__} reads byte records its own way: not through DataOnlyReader"
            )
        self.planner = planner

    def __getattr__(self, name: str):
        return getattr(self.planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        planner, name = self.planner, read_item.dest_index.fqn
        loaded = load_record(value, name)
        if planner.flatten_state_dict:  # (as DefaultLoadPlanner.load_bytes stores it, torch 2.13)
            set_element(planner.original_state_dict, planner.mappings[name], loaded)
        else:
            planner.state_dict[name] = loaded
