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

SAMPLE_CORPUS = Path(__file__).resolve().parent / "sample" / "python_docs.jsonl"
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")

SourcePosition = Any  # a list of ints or a string, as the source defines it (see above)


class DocumentSource(Protocol):
    def documents(self, start: SourcePosition | None = None) -> Iterator[tuple[SourcePosition, str]]:
        """One epoch of (position, text) from the document at `start` (None: the first) on."""
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
                    text = _text_of(json.loads(line), self.text_field, f"{file}:{line_number}")
                    yield [index, offset, line_number], text
                offset += len(line)
                line_number += 1

    def _parquet_documents(self, index: int, first_group: int = 0, first_row: int = 0) -> Iterator:
        import pyarrow.parquet as pq

        file = self.files[index]
        parquet = pq.ParquetFile(file)
        if self.text_field not in parquet.schema_arrow.names:
            raise UserError(f"{file} has no column '{self.text_field}' (training.dataset_text_field)")
        for group in range(first_group, parquet.num_row_groups):
            row = first_row if group == first_group else 0
            # Batches bound the memory a large row group takes; rows before `row` are skipped.
            batches = parquet.iter_batches(batch_size=1024, row_groups=[group], columns=[self.text_field])
            batch_start = 0
            for batch in batches:
                texts = batch.column(0).to_pylist()[max(row - batch_start, 0) :]
                for text in texts:
                    yield [index, group, row], text or ""
                    row += 1
                batch_start += batch.num_rows


def _text_of(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise UserError(f"{where} has no field '{text_field}' (training.dataset_text_field)")
    return row[text_field]


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
            yield position, _text_of(row, self.text_field, f"dataset {self.name}")
            position = json.dumps(stream.state_dict())


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
