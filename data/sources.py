"""Where documents come from: local text files, Hugging Face datasets, or the bundled sample.

Every source yields documents in one fixed order and can restart at any document index, which is
what lets a run resume exactly (data/packing.py records positions as document indices).
Token shards written by scripts/prepare_data.py are read by data/shards.py instead.
"""

import glob
import json
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

from configs import UserError

SAMPLE_CORPUS = Path(__file__).resolve().parent / "sample" / "python_docs.jsonl"
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")

# A source: documents(start) yields the documents from index `start` on, once (one epoch).
DocumentSource = Callable[[int], Iterator[str]]


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


def text_file_documents(files: list[Path], text_field: str) -> DocumentSource:
    """.txt: one document per file; .jsonl: one per line; .parquet: one per row."""

    def documents(start: int) -> Iterator[str]:
        return islice(_all_documents(files, text_field), start, None)

    return documents


def _all_documents(files: list[Path], text_field: str) -> Iterator[str]:
    for file in files:
        yield from _file_documents(file, text_field)


def _file_documents(file: Path, text_field: str) -> Iterator[str]:
    if file.suffix == ".txt":
        yield file.read_text(encoding="utf-8", errors="replace")
    elif file.suffix == ".jsonl":
        with file.open(encoding="utf-8") as lines:
            for line_number, line in enumerate(lines, 1):
                if line.strip():
                    yield _text_of(json.loads(line), text_field, f"{file}:{line_number}")
    else:
        yield from _parquet_documents(file, text_field)


def _parquet_documents(file: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    if text_field not in parquet.schema_arrow.names:
        raise UserError(f"{file} has no column '{text_field}' (training.dataset_text_field)")
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        yield from (text or "" for text in batch.column(0).to_pylist())


def _text_of(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise UserError(f"{where} has no field '{text_field}' (training.dataset_text_field)")
    return row[text_field]


def hf_documents(name: str, subset: str, split: str, text_field: str) -> DocumentSource:
    """A Hugging Face dataset, streamed; needs the `datasets` package and network access."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            "training.dataset = 'hf' needs the `datasets` package (pip install datasets)"
        ) from None

    def documents(start: int) -> Iterator[str]:
        stream = datasets.load_dataset(name, subset or None, split=split, streaming=True)
        for row in stream.skip(start):
            yield _text_of(row, text_field, f"dataset {name}")

    return documents


def build_document_source(
    dataset: str, dataset_path: str, text_field: str, subset: str, split: str
) -> DocumentSource:
    if dataset == "python_docs":
        return text_file_documents([SAMPLE_CORPUS], "text")
    if dataset == "text":
        return text_file_documents(find_text_files(dataset_path), text_field)
    if dataset == "hf":
        return hf_documents(dataset_path, subset, split, text_field)
    raise ValueError(f"not a document source: {dataset}")
