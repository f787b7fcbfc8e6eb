"""Where documents come from: local text files, Hugging Face datasets, or the bundled sample.

A source reads one epoch of documents in a fixed order and gives each with its position: a plain
value (lists of ints, or a string) that restarts reading at that document directly, so a resume
costs the same deep into a corpus as at its start (data/packing.py keeps it in the data state):

    .txt      [file index, byte offset, 1 if the piece ends the file else 0]: one document per
              file, read in pieces of about 4 MiB (memory does not grow with the file), each cut
              before a space that follows a non-space, where byte-level BPE pre-tokenizers and the
              byte tokenizer split anyway: the same tokens as the whole file ([file index], from
              older checkpoints, is its start)
    .jsonl    [file index, byte offset of the line, line number]
    .parquet  [file index, row group, row within the group]; the row group is read from its start
    hf        the stream's own state_dict() (datasets >= 2.18) as a JSON string; datasets restarts
              at the position's shard and skips the examples before it in that shard

Bytes that are not UTF-8 are read as U+FFFD, in every format, with one warning per file naming
the count. Token shards written by scripts/prepare_data.py are read by data/shards.py instead.
"""

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from configs import UserError
from configs.errors import first_line
from data.file_search import find_text_files

logger = logging.getLogger(__name__)
SAMPLE_CORPUS = Path(__file__).resolve().parent / "sample" / "python_docs.jsonl"
TXT_PIECE_BYTES = 4 * 2**20
WHITESPACE = b" \t\n\r\x0b\x0c"
LISTED_FILES = 10_000  # a data state lists the files up to this many (a digest beyond)

SourcePosition = Any  # a list of ints or a string, as the source defines it (see above)


class DocumentSource(Protocol):
    def documents(self, start: SourcePosition | None = None) -> Iterator[tuple[SourcePosition, str]]:
        """One epoch of (position, text) from the document at `start` (None: the first) on; a long
        document may come in pieces (then ends_document says which piece is its last)."""
        ...

    def where(self, position: SourcePosition) -> str:
        """Names the document at `position` in error messages (a file and line, a row)."""
        ...


class TextFiles:
    """.txt: one document per file; .jsonl: one per line; .parquet: one per row."""

    def __init__(self, files: list[Path], text_field: str):
        self.files = files
        self.text_field = text_field
        self._warned: set[int] = set()  # files whose non-UTF-8 bytes were reported

    def ends_document(self, position: list[int]) -> bool:
        """Whether the text at position ends its document: a .txt file's last piece, or any other."""
        return self.files[position[0]].suffix != ".txt" or len(position) < 3 or bool(position[2])

    def describe(self) -> dict:
        """What the data state records of the files, to notice a changed corpus on resume: each
        file's path (relative to their common folder) and size, or with very many a digest."""
        root = os.path.commonpath([str(f.parent) for f in self.files])
        listed = [[os.path.relpath(f, root), f.stat().st_size] for f in self.files]
        if len(listed) <= LISTED_FILES:
            return {"files": listed}
        import hashlib

        digest = hashlib.sha256(json.dumps(listed).encode()).hexdigest()
        return {"file_count": len(listed), "files_digest": digest}

    def documents(self, start: list[int] | None = None) -> Iterator[tuple[list[int], str]]:
        first_file, *within_first = start or [0]
        for index in range(first_file, len(self.files)):
            within = within_first if index == first_file else []
            suffix = self.files[index].suffix
            if suffix == ".txt":
                yield from self._txt_pieces(index, *within[:1])
            elif suffix == ".jsonl":
                yield from self._jsonl_documents(index, *within)
            else:
                yield from self._parquet_documents(index, *within)

    def _txt_pieces(self, index: int, offset: int = 0) -> Iterator:
        """The file's text from byte offset on, in pieces: each one the bytes up to the last space
        after a non-space within TXT_PIECE_BYTES of its start (twice that, ... if there is none),
        so that where a piece ends depends on where it starts alone, and a resume at a piece reads
        the same pieces."""
        replaced = 0
        with self.files[index].open("rb") as file:
            file.seek(offset)
            pending, exhausted = b"", False
            while True:
                size, cut = TXT_PIECE_BYTES, None
                while True:
                    while not exhausted and len(pending) <= size:  # one byte more: is there a rest?
                        more = file.read(TXT_PIECE_BYTES)
                        exhausted, pending = not more, pending + more
                    if exhausted and len(pending) <= size:
                        break  # the rest of the file is the last piece
                    cut = _cut(pending[:size])
                    if cut is not None:
                        break
                    size *= 2
                text, count = _decode(pending if cut is None else pending[:cut])
                replaced += count
                # universal newlines, as reading in text mode did ("\r\n" never spans a cut)
                yield [index, offset, int(cut is None)], text.replace("\r\n", "\n").replace("\r", "\n")
                if cut is None:
                    break
                offset, pending = offset + cut, pending[cut:]
        self._report_replaced(index, replaced)

    def _jsonl_documents(self, index: int, offset: int = 0, line_number: int = 1) -> Iterator:
        file, replaced = self.files[index], 0
        with file.open("rb") as lines:
            lines.seek(offset)
            for line in lines:
                if line.strip():
                    where = f"{file}:{line_number}"
                    decoded, count = _decode(line)
                    replaced += count
                    text = _text_of(_json_object(decoded, where), self.text_field, where)
                    yield [index, offset, line_number], text
                offset += len(line)
                line_number += 1
        self._report_replaced(index, replaced)

    def _report_replaced(self, index: int, count: int) -> None:
        if count and index not in self._warned:
            self._warned.add(index)
            logger.warning(f"{self.files[index]}: {count:,} bytes are not UTF-8; read as U+FFFD")

    def _parquet_documents(self, index: int, first_group: int = 0, first_row: int = 0) -> Iterator:
        import pyarrow as pa
        import pyarrow.parquet as pq

        file = self.files[index]
        try:
            parquet = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{file} is not a Parquet file ({first_line(e)})") from None
        if self.text_field not in parquet.schema_arrow.names:
            raise UserError(f"{file} has no column '{self.text_field}' (training.dataset_text_field)")
        column_type = parquet.schema_arrow.field(self.text_field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise UserError(f"{file}: column '{self.text_field}' holds {column_type}, not text")
        for group in range(first_group, parquet.num_row_groups):
            row = first_row if group == first_group else 0
            for text in _row_group_texts(parquet, file, group, self.text_field, row):
                if text is None:
                    raise UserError(f"{self.where([index, group, row])}: '{self.text_field}' is null")
                yield [index, group, row], text
                row += 1

    def reposition(self, position: list[int], offset: int, saved: dict) -> tuple[list[int] | None, int]:
        """(position, token offset) in this corpus for a position saved in another (saved: its
        describe()): the same place in the same file if it is still there unchanged, the file's
        start if its size changed, else the next file in order; (None, 0): the epoch's start."""
        listed = saved.get("files")
        if not listed or position[0] >= len(listed):
            return None, 0
        path, size = listed[position[0]]
        ours = self.describe()["files"]
        names = [name for name, _ in ours]
        if path in names:  # the same place in it if it is unchanged, else its start
            index = names.index(path)
            return ([index, *position[1:]], offset) if ours[index][1] == size else ([index], 0)
        later = [i for i, name in enumerate(names) if name > path]
        return ([later[0]], 0) if later else (None, 0)

    def where(self, position: list[int]) -> str:
        """The file (and line or row) a position names, for error messages."""
        file = self.files[position[0]]
        if len(position) < 3:  # a file's start
            return str(file)
        if file.suffix == ".jsonl":
            return f"{file}:{position[2]}"
        if file.suffix == ".parquet":
            return f"{file} row group {position[1]}, row {position[2]}"
        return str(file)


def _row_group_texts(parquet, file: Path, group: int, column: str, first_row: int) -> Iterator[str | None]:
    """A row group's texts from `first_row` on; batches bound the memory a large row group takes."""
    import pyarrow as pa

    batch_start = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024, row_groups=[group], columns=[column]):
            yield from batch.column(0).to_pylist()[max(first_row - batch_start, 0) :]
            batch_start += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{file} row group {group} cannot be read ({first_line(e)})") from None


def corpus_changes(saved: dict, current: dict) -> str:
    """What differs between two TextFiles.describe() records ("" if nothing), for messages."""
    if saved.get("files") is None or current.get("files") is None:
        same = {k: saved.get(k) for k in ("file_count", "files_digest")} == {
            k: current.get(k) for k in ("file_count", "files_digest")
        }
        return "" if same else f"{saved.get('file_count')} files there, {current.get('file_count')} here"
    theirs, ours = dict(map(tuple, saved["files"])), dict(map(tuple, current["files"]))
    if list(theirs) == list(ours) and theirs == ours:
        return ""
    added = [name for name in ours if name not in theirs]
    removed = [name for name in theirs if name not in ours]
    resized = [name for name in ours if name in theirs and ours[name] != theirs[name]]
    show = lambda names: ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    found = [f"{what} {show(names)}" for what, names in (("added", added), ("removed", removed),
                                                         ("changed", resized)) if names]  # fmt: skip
    return "; ".join(found)


def _cut(data: bytes) -> int | None:
    """Where a piece of a .txt file ends: at the last space after a non-space (None: no such point).
    (A space byte is never inside a multi-byte UTF-8 character.)"""
    cut = data.rfind(b" ")
    while cut > 0:
        if data[cut - 1] not in WHITESPACE:
            return cut
        cut = data.rfind(b" ", 0, cut)
    return None


def _decode(data: bytes) -> tuple[str, int]:
    """UTF-8 text and how many bytes were not UTF-8 (each read as U+FFFD)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.count("\ufffd".encode())


def _json_object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError as e:  # JSONDecodeError
        raise UserError(f"{where} is not a line of JSON ({first_line(e)})") from None
    if not isinstance(row, dict):
        raise UserError(f"{where} is {_json_kind(row)}, not a JSON object")
    return row


def _text_of(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise UserError(f"{where} has no field '{text_field}' (training.dataset_text_field)")
    text = row[text_field]
    if not isinstance(text, str):
        raise UserError(f"{where}: field '{text_field}' is {_json_kind(text)}, not a string")
    return text


def _json_kind(value) -> str:
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return kinds.get(type(value), f"a {type(value).__name__}")


class HFStream:
    """A Hugging Face dataset, streamed; needs the `datasets` package and network access."""

    def __init__(self, name: str, subset: str, split: str, text_field: str):
        try:
            import datasets
        except ImportError:
            raise UserError(
                "training.dataset = 'hf' needs the `datasets` package (pip install datasets)"
            ) from None
        if not hasattr(datasets.IterableDataset, "load_state_dict"):
            raise UserError("training.dataset = 'hf' needs datasets >= 2.18 (pip install -U datasets)")
        self.load = lambda: datasets.load_dataset(name, subset or None, split=split, streaming=True)
        self.name = name
        self.text_field = text_field

    def documents(self, start: str | None = None) -> Iterator[tuple[str, str]]:
        stream = self.load()
        if start is not None:
            stream.load_state_dict(json.loads(start))
        # The state after a document is the position of the next; datasets keeps it per example.
        position = json.dumps(stream.state_dict())
        for row in stream:
            yield position, _text_of(row, self.text_field, self.where(position))
            position = json.dumps(stream.state_dict())

    def where(self, position: str) -> str:
        return f"dataset {self.name}"

    def describe(self) -> dict:
        return {"dataset": self.name}


def build_document_source(
    dataset: str, dataset_path: str, text_field: str, subset: str, split: str
) -> DocumentSource:
    if dataset == "python_docs":
        return TextFiles([SAMPLE_CORPUS], "text")
    if dataset == "text":
        return TextFiles(find_text_files(dataset_path), text_field)
    if dataset == "hf":
        return HFStream(dataset_path, subset, split, text_field)
    raise ValueError(f"not a document source: {dataset}")
