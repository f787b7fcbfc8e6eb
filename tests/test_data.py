"""Tokenizers, sources, packing, token shards, the global sample order and exact loader resume."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from configs import UserError, load_config
from data.loader import GlobalOrderDataset, build_dataloader, build_source
from data.packing import PackedTextStream
from data.shards import TokenShards
from data.sources import SAMPLE_CORPUS, build_document_source, find_text_files
from data.tokenizer import ByteTokenizer, build_tokenizer

DOCS = ["first document", "", "a second, longer document with ünïcode ✓", "x" * 50, "the end"]


def list_source(docs):
    return lambda start: iter(docs[start:])


def expected_stream(docs, tokenizer, repeats: int) -> np.ndarray:
    one_epoch = [t for d in docs for t in tokenizer.encode(d) + [tokenizer.eos_id]]
    return np.array(one_epoch * repeats)


def training_config(*argv):
    return load_config(["--training.seq_len", "16", "--training.local_batch_size", "2", *argv]).training


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "héllo wörld ✓\n\ttabs"
    ids = tokenizer.encode(text)
    assert max(ids) < 256 and tokenizer.decode(ids) == text
    assert tokenizer.encode_batch([text, "a"]) == [ids, [97]]


@pytest.fixture(scope="module")
def hf_assets(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf_assets")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    lines = [json.loads(line)["text"] for line in SAMPLE_CORPUS.read_text().splitlines()[:10]]
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"})
    )
    return folder


def test_hf_tokenizer_round_trip(hf_assets):
    tokenizer = build_tokenizer(str(hf_assets))
    text = "The assert statement: héllo ✓"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges happened
    assert tokenizer.eos_id == tokenizer._tokenizer.token_to_id("</s>")
    assert tokenizer.bos_id == tokenizer._tokenizer.token_to_id("<s>")
    assert tokenizer.vocab_size == 400
    assert tokenizer.encode_batch([text]) == [ids]


def test_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="is not a folder"):
        build_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no tokenizer.json"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        build_tokenizer(str(tmp_path))


@pytest.mark.parametrize("seq_len", [1, 4, 7, 32])
def test_samples_are_windows_of_the_document_stream(seq_len):
    tokenizer = ByteTokenizer()
    stream = PackedTextStream(list_source(DOCS), tokenizer, seq_len)
    expected = expected_stream(DOCS, tokenizer, repeats=8)
    samples = stream.samples(0, 0, (0, 0, 0))
    for k in range(len(expected) // seq_len - 2):  # crosses several epochs
        index, _, read = next(samples)
        assert index == k
        np.testing.assert_array_equal(read(), expected[k * seq_len : (k + 1) * seq_len + 1])


def test_stream_restarts_from_any_recorded_position():
    tokenizer = ByteTokenizer()
    stream = PackedTextStream(list_source(DOCS), tokenizer, 5)
    reference = [
        (k, pos, read().copy()) for (k, pos, read), _ in zip(stream.samples(0, 0, (0, 0, 0)), range(60))
    ]
    for anchor in (0, 3, 17, 31, 44):
        _, position, _ = reference[anchor]
        for (k, pos, read), (k_ref, pos_ref, tokens) in zip(
            stream.samples(anchor + 2, anchor * 5, position), reference[anchor + 2 :]
        ):
            assert (k, pos) == (k_ref, pos_ref)
            np.testing.assert_array_equal(read(), tokens)


def test_empty_dataset_is_an_error():
    stream = PackedTextStream(list_source([]), ByteTokenizer(), 4)
    with pytest.raises(UserError, match="no documents"):
        next(stream.samples(0, 0, (0, 0, 0)))


def step_sample_ids(dataset: GlobalOrderDataset, steps: int, per_rank: int) -> list[list[int]]:
    it = iter(dataset)
    return [[next(it)["sample_id"] for _ in range(per_rank)] for _ in range(steps)]


@pytest.mark.parametrize("dp_degree", [1, 2, 4])
def test_steps_read_consecutive_global_samples_split_over_ranks(dp_degree):
    global_batch, steps = 8, 4
    per_rank = global_batch // dp_degree
    source = build_source(training_config(), ByteTokenizer())
    ranks = [
        step_sample_ids(GlobalOrderDataset(source, 16, global_batch, r, dp_degree), steps, per_rank)
        for r in range(dp_degree)
    ]
    for step in range(steps):
        ids = [i for r in range(dp_degree) for i in ranks[r][step]]
        assert ids == list(range(step * global_batch, (step + 1) * global_batch))


def run_steps(dataset, steps, per_rank):
    it = iter(dataset)
    out = []
    for _ in range(steps):
        out.append([(s["sample_id"], s["tokens"].clone()) for s in (next(it) for _ in range(per_rank))])
    return out


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_resume_on_other_data_parallel_degree_reads_the_same_samples(kind, tmp_path):
    if kind == "tokens":
        shards = tmp_path / "shards"
        subprocess.run([sys.executable, str(REPO / "scripts/prepare_data.py"), "--dataset", "python_docs",
                        "--output", str(shards)], check=True, capture_output=True)  # fmt: skip
        training = training_config("--training.dataset", "tokens", "--training.dataset_path", str(shards))
    else:
        training = training_config()
    source = build_source(training, ByteTokenizer())
    global_batch = 8
    # Uninterrupted: one rank reading everything (dp 1).
    whole = run_steps(GlobalOrderDataset(source, 16, global_batch, 0, 1), 5, 8)
    # Interrupted after 2 steps on dp 2; every rank holds the same state.
    first = [GlobalOrderDataset(source, 16, global_batch, r, 2) for r in range(2)]
    for dataset in first:
        run_steps(dataset, 2, 4)
    states = [d.state_dict() for d in first]
    assert states[0] == states[1] and states[0]["cursor"] == 16
    # Resumed on dp 4.
    resumed = [GlobalOrderDataset(source, 16, global_batch, r, 4) for r in range(4)]
    for dataset in resumed:
        dataset.load_state_dict(states[0])
    per_rank = [run_steps(d, 3, 2) for d in resumed]
    for step in range(3):
        got = [sample for r in range(4) for sample in per_rank[r][step]]
        want = whole[2 + step]
        assert [i for i, _ in got] == [i for i, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert torch.equal(a, b)


def test_state_is_only_defined_between_steps():
    dataset = GlobalOrderDataset(build_source(training_config(), ByteTokenizer()), 16, 4, 0, 1)
    it = iter(dataset)
    next(it)
    with pytest.raises(RuntimeError, match="between optimizer steps"):
        dataset.state_dict()


def test_changed_seq_len_continues_at_the_same_token():
    source = build_source(training_config(), ByteTokenizer())
    old = GlobalOrderDataset(source, 16, 4, 0, 1)
    run_steps(old, 3, 4)  # 12 samples of 16 tokens = token 192
    longer = GlobalOrderDataset(
        build_source(training_config("--training.seq_len", "32"), ByteTokenizer()), 32, 4, 0, 1
    )
    longer.load_state_dict(old.state_dict())
    assert next(iter(longer))["sample_id"] == 6  # token 192 / 32


def test_stateful_dataloader_round_trip():
    training = training_config()
    loader = build_dataloader(training, ByteTokenizer(), global_batch_size=4, dp_rank=0, dp_degree=1)
    it = iter(loader)
    for _ in range(6):  # 3 steps of 2 micro-batches
        next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(4)]
    fresh = build_dataloader(training, ByteTokenizer(), global_batch_size=4, dp_rank=0, dp_degree=1)
    fresh.load_state_dict(state)
    got = [b for b, _ in zip(fresh, range(4))]
    for a, b in zip(got, expected):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["labels"], b["labels"])
        assert torch.equal(a["sample_ids"], b["sample_ids"])
    assert torch.equal(got[0]["input"][:, 1:], got[0]["labels"][:, :-1])  # labels are inputs shifted


def test_text_files_in_every_format(tmp_path):
    import pyarrow
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"body": "json one"}) + "\n\n" + json.dumps({"body": "json two"}) + "\n"
    )
    pq.write_table(pyarrow.table({"body": ["parquet one", "parquet two"]}), tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("not read")
    documents = build_document_source("text", str(tmp_path), "body", "", "train")
    assert list(documents(0)) == ["plain text file", "json one", "json two", "parquet one", "parquet two"]
    assert list(documents(3)) == ["parquet one", "parquet two"]
    assert [p.name for p in find_text_files(str(tmp_path / "*.jsonl"))] == ["b.jsonl"]


def test_source_errors(tmp_path):
    with pytest.raises(UserError, match="names no .txt, .jsonl or .parquet files"):
        find_text_files(str(tmp_path / "nothing*"))
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    documents = build_document_source("text", str(tmp_path), "text", "", "train")
    with pytest.raises(UserError, match="has no field 'text'"):
        list(documents(0))


def test_prepared_shards_hold_the_same_samples_as_the_text_stream(tmp_path):
    output = tmp_path / "shards"
    command = [sys.executable, str(REPO / "scripts/prepare_data.py"), "--dataset", "python_docs",
               "--output", str(output), "--shard-tokens", "100000"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    meta = json.loads((output / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and len(meta["shards"]) >= 1
    shards = TokenShards(str(output), 64)
    stream = PackedTextStream(
        build_document_source("python_docs", "", "text", "", "train"), ByteTokenizer(), 64
    )
    for (k, _, read), _ in zip(stream.samples(0, 0, (0, 0, 0)), range(300)):
        np.testing.assert_array_equal(shards.sample(k), read())
    # An existing output is never overwritten.
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_truncated_shard_is_an_error(tmp_path):
    output = tmp_path / "shards"
    subprocess.run([sys.executable, str(REPO / "scripts/prepare_data.py"), "--dataset", "python_docs",
                    "--output", str(output)], check=True, capture_output=True)  # fmt: skip
    shard = output / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(UserError, match="missing or truncated"):
        TokenShards(str(output), 64)


def test_shards_from_another_tokenizer_are_refused(tmp_path, hf_assets):
    output = tmp_path / "shards"
    subprocess.run([sys.executable, str(REPO / "scripts/prepare_data.py"), "--dataset", "python_docs",
                    "--output", str(output)], check=True, capture_output=True)  # fmt: skip
    training = training_config("--training.dataset", "tokens", "--training.dataset_path", str(output))
    with pytest.raises(UserError, match="made with a tokenizer of 258 tokens"):
        build_source(training, build_tokenizer(str(hf_assets)))
