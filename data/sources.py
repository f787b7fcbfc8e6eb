"""Where documents come from: local text files, Hugging Face datasets, or the bundled sample.

A source reads one epoch of documents in a fixed order and gives each with its position: a plain
value (lists of ints, or a string) that restarts reading at that document directly, so a resume
costs the same deep into a corpus as at its start (data/packing.py keeps it in the data state):

    .txt      [file index]                       one document per file
    .jsonl    [file index, byte offset of the line, line number]
    .parquet  [file index, row group, row within the group]; the row group is read from its start
    hf        the stream's own state_dict() (datasets >= 2.18) as a JSON string; datasets restarts
              at the position's shard and skips the examples before it in that shard

Token shards written by scripts/prepare_data.py are read by data/shards.py instead.
"""

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from configs import UserError
from configs.errors import first_line

SAMPLE_CORPUS = Path(__file__).resolve().parent / "sample" / "python_docs.jsonl"
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")

SourcePosition = Any  # a list of ints or a string, as the source defines it (see above)


class DocumentSource(Protocol):
    def documents(self, start: SourcePosition | None = None) -> Iterator[tuple[SourcePosition, str]]:
        """One epoch of (position, text) from the document at `start` (None: the first) on."""
        ...

    def where(self, position: SourcePosition) -> str:
        """Names the document at `position` in error messages (a file and line, a row)."""
        ...


def find_text_files(dataset_path: str) -> list[Path]:
    """A file, a folder (searched recursively) or a glob -> the text files it names, sorted."""
    path = Path(dataset_path)
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file()]
    elif path.is_file():
        candidates = [path]
    else:
        candidates = [Path(p) for p in glob.glob(dataset_path, recursive=True)]
    files = sorted(p for p in candidates if p.suffix in TEXT_SUFFIXES)
    if not files:
        raise UserError(f"training.dataset_path '{dataset_path}' names no .txt, .jsonl or .parquet files")
    return files


class TextFiles:
    """.txt: one document per file; .jsonl: one per line; .parquet: one per row."""

    def __init__(self, files: list[Path], text_field: str):
        self.files = files
        self.text_field = text_field

    def documents(self, start: list[int] | None = None) -> Iterator[tuple[list[int], str]]:
        first_file, *within_first = start or [0]
        for index in range(first_file, len(self.files)):
            within = within_first if index == first_file else []
            suffix = self.files[index].suffix
            if suffix == ".txt":
                yield [index], self.files[index].read_text(encoding="utf-8", errors="replace")
            elif suffix == ".jsonl":
                yield from self._jsonl_documents(index, *within)
            else:
                yield from self._parquet_documents(index, *within)

    def _jsonl_documents(self, index: int, offset: int = 0, line_number: int = 1) -> Iterator:
        file = self.files[index]
        with file.open("rb") as lines:
            lines.seek(offset)
            for line in lines:
                if line.strip():
                    where = f"{file}:{line_number}"
                    text = _text_of(_json_object(line, where), self.text_field, where)
                    yield [index, offset, line_number], text
                offset += len(line)
                line_number += 1

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

    def where(self, position: list[int]) -> str:
        """The file (and line or row) a position names, for error messages."""
        file = self.files[position[0]]
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


def _json_object(line: bytes, where: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
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
