"""One rank's DCP save on the fast path: the same in the training process for a blocking save and
in the writer process, or thread, for an async one, through this path's data files
(checkpoint/fast_io/data_files.py) and its save planner.

Serializing. `SaveOnceEachValue`: DCP's save planner with each distinct plain value (the
optimizer's per-parameter hyperparameters) serialized once per save, less Python work in the
writer threads beside training.
"""

import io
from pathlib import Path

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from checkpoint.fast_io.data_files import storage_writer
from checkpoint.storage import Written, save_files


def write_files(
    state: dict, partial: Path, rank: int, writer_threads: int, direct_io: bool, process_group=None
) -> Written:
    """DCP-save state into the folder partial: (this rank's files' checksums, taken while they were
    written, or what went wrong; seconds spent checksumming files read back)."""
    writer = storage_writer(partial, writer_threads, direct_io)
    return save_files(state, partial, rank, writer, SaveOnceEachValue(), process_group)


class SaveOnceEachValue(DefaultSavePlanner):
    """DCP's save planner, serializing each distinct plain value once per save.

    DCP stores every non-tensor entry of the state as its own torch.save record, made in the
    writer threads while training runs on. The optimizer's state lists its hyperparameters per
    parameter (lr, betas, eps, ... x 147 parameters = 1,764 records at Llama 3 1B), nearly all
    equal; serializing each takes Python time that, in an async save's writer threads, holds the
    GIL which the training thread needs at every kernel launch (docs/checkpointing.md). Equal plain
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
