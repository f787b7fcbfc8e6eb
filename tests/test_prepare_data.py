"""scripts/prepare_data.py --workers: the same bytes as one process for any number of workers and
any unit size, a rerun that reuses finished units, and mistakes that end in one `error:` line."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from data.packing import tokenize
from data.preparation import plan_units
from data.shards import write_meta
from data.sources import SAMPLE_CORPUS, build_document_source
from data.tokenizer import build_tokenizer

UNIT_BYTES = 700  # tiny: the big .jsonl and the .parquet file each span several units
SHARD_TOKENS = 1000  # several shards, cut across unit boundaries
TEXTS = [json.loads(line)["text"] for line in SAMPLE_CORPUS.read_text().splitlines()]


def pieces(count: int, seed: int) -> list[str]:
    """Pieces of the sample corpus, 0 to 200 characters (some empty: EOS alone)."""
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        text = TEXTS[rng.randrange(len(TEXTS))]
        start = rng.randrange(len(text))
        found.append(text[start : start + rng.randrange(200)])
    return found


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import pyarrow
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("corpus")
    # With bytes, exactly one shard's tokens with its EOS: the first shard ends with this file.
    (folder / "00_intro.txt").write_text(("A shard of its own. " * 100)[: SHARD_TOKENS - 1])
    write_jsonl(folder / "01_small.jsonl", pieces(3, 1))
    with (folder / "01_small.jsonl").open("a") as file:
        file.write("\n")  # a blank line: no document
    write_jsonl(folder / "02_big.jsonl", pieces(60, 2))
    (folder / "03_notes.txt").write_text(pieces(1, 3)[0] + " ünïcode ✓")
    pq.write_table(pyarrow.table({"text": pieces(40, 4)}), folder / "04_rows.parquet", row_group_size=4)
    write_jsonl(folder / "05_tail.jsonl", pieces(2, 5))
    return folder


@pytest.fixture(scope="module")
def hf_assets(tmp_path_factory, corpus) -> Path:
    """A tiny byte-level BPE whose end-of-text token is <|endoftext|> (found by data/tokenizer.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf_assets")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(TEXTS[:20], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def prepare_in_one_process(dataset_path: Path, hf_assets_path: str, output: Path) -> dict[str, bytes]:
    """The reference: what prepare_data.py wrote before --workers existed (data.packing.tokenize
    over the whole corpus in one process, a shard closed after the document that fills it)."""
    tokenizer = build_tokenizer(hf_assets_path)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    output.mkdir()
    shards, pending = [], []
    source = build_document_source("text", str(dataset_path), "text", "", "train")
    for _, tokens in tokenize(source, tokenizer):
        pending.append(tokens)
        if sum(map(len, pending)) >= SHARD_TOKENS:
            shards.append(np.concatenate(pending))
            pending = []
    if pending:
        shards.append(np.concatenate(pending))
    names = [f"tokens-{index:05d}.bin" for index in range(len(shards))]
    for name, tokens in zip(names, shards):
        tokens.astype(dtype).tofile(output / name)
    records = [{"file": name, "num_tokens": len(tokens)} for name, tokens in zip(names, shards)]
    write_meta(output, np.dtype(dtype).name, tokenizer.vocab_size, tokenizer.eos_id,
               hf_assets_path or "byte", tokenizer.identity, records)  # fmt: skip
    return contents(output)


def contents(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def prepare_data(dataset_path: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    """scripts/prepare_data.py on a text corpus; a flag given again in `extra` wins (argparse keeps
    the last)."""
    command = [sys.executable, str(REPO / "scripts/prepare_data.py"), "--dataset", "text",
               "--dataset-path", str(dataset_path), "--output", str(output),
               "--shard-tokens", str(SHARD_TOKENS), "--unit-bytes", str(UNIT_BYTES), *extra]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_same_bytes_for_any_number_of_workers_as_one_process(tokenizer, corpus, hf_assets, tmp_path):
    hf_assets_path = str(hf_assets) if tokenizer == "hf" else ""
    reference = prepare_in_one_process(corpus, hf_assets_path, tmp_path / "reference")
    source = build_document_source("text", str(corpus), "text", "", "train")
    for workers, unit_bytes in ((1, UNIT_BYTES), (2, UNIT_BYTES), (3, UNIT_BYTES // 2)):
        units = plan_units(source, unit_bytes)
        # The test means something: units cut inside files, and shards cut across units.
        kinds = [unit.kind for unit in units]
        assert kinds.count("jsonl") >= 4 and kinds.count("parquet") >= 3
        assert 3 <= len(reference) - 1 < len(units)
        output = tmp_path / f"workers_{workers}"
        result = prepare_data(corpus, output, "--workers", str(workers), "--unit-bytes", str(unit_bytes),
                              "--hf-assets-path", hf_assets_path)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert contents(output) == reference, f"--workers {workers} --unit-bytes {unit_bytes}"
        assert f"units {len(units)}/{len(units)}," in result.stdout
        assert not output.with_name(output.name + ".partial").exists()


def test_rerun_after_a_bad_line_is_fixed_reuses_the_finished_units(corpus, tmp_path):
    dataset = tmp_path / "corpus"
    shutil.copytree(corpus, dataset)
    late = dataset / "99_late.jsonl"  # a big file, last
    texts = pieces(40, 6)
    write_jsonl(late, texts)
    lines = late.read_text().splitlines(keepends=True)
    bad_line = 25
    lines[bad_line - 1] = '{"text": "cut short\n'
    late.write_text("".join(lines))
    output = tmp_path / "shards"

    error = f"error: {late}:{bad_line} is not a line of JSON"
    # The line number counts from the file's start, though its unit starts inside the file.
    assert error in one_error_line(prepare_data(dataset, output, "--workers", "2"))
    # Two workers stop where they are; one process stops at the bad unit, every unit before it done.
    assert error in one_error_line(prepare_data(dataset, output, "--workers", "1"))
    bad_offset = sum(len(line.encode()) for line in lines[: bad_line - 1])
    units = plan_units(build_document_source("text", str(dataset), "text", "", "train"), UNIT_BYTES)
    assert any(u.kind == "jsonl" and 0 < u.start <= bad_offset < u.stop for u in units)

    write_jsonl(late, texts)  # fixed: its units are redone, the others' are reused
    rerun = prepare_data(dataset, output, "--workers", "2")
    assert rerun.returncode == 0, rerun.stderr
    before_late = sum(str(late) not in {path for path, _, _ in unit.files} for unit in units)
    assert f"units, {before_late} reused from an earlier run" in rerun.stdout
    assert contents(output) == prepare_in_one_process(dataset, "", tmp_path / "clean")


@pytest.mark.parametrize("other", [["--shard-tokens", "999"], ["--hf-assets-path", "HF"]])
def test_unfinished_preparation_with_other_arguments_is_refused(other, hf_assets, tmp_path):
    dataset = tmp_path / "corpus"
    dataset.mkdir()
    write_jsonl(dataset / "a.jsonl", pieces(12, 7))  # more than a unit
    (dataset / "b.jsonl").write_text('{"text": 1}\n')
    output = tmp_path / "shards"
    one_error_line(prepare_data(dataset, output))  # a.jsonl's units are finished, b.jsonl's is not
    partial = tmp_path / "shards.partial"
    before = {path: path.read_bytes() for path in partial.rglob("*") if path.is_file()}
    assert any(path.suffix == ".tokens" for path in before)

    other = [str(hf_assets) if value == "HF" else value for value in other]
    error = one_error_line(prepare_data(dataset, output, *other))
    assert other[0] in error and f"delete '{partial}'" in error and "with its arguments" in error
    assert {path: path.read_bytes() for path in partial.rglob("*") if path.is_file()} == before
