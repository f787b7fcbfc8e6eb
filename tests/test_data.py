"""Tokenizers, sources, packing, token shards, the global sample order and exact loader resume."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from configs import UserError, load_config
from data.loader import GlobalSampleOrder, build_dataloader, build_source
from data.mixture import ShardMixture
from data.packing import START, PackedTextStream
from data.shards import TokenShards
from data.sources import SAMPLE_CORPUS, TextFiles, build_document_source, find_text_files
from data.tokenizer import ByteTokenizer, build_tokenizer

DOCS = ["first document", "", "a second, longer document with ünïcode ✓", "x" * 50, "the end"]


class ListSource:
    """Documents in memory; a position is [index]."""

    def __init__(self, docs: list[str]):
        self.docs = docs

    def documents(self, start=None):
        for index in range(start[0] if start else 0, len(self.docs)):
            yield [index], self.docs[index]

    def where(self, position):
        return f"document {position[0]}"


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
    stream = PackedTextStream(ListSource(DOCS), tokenizer, seq_len)
    expected = expected_stream(DOCS, tokenizer, repeats=8)
    samples = stream.samples(0, 0, START)
    for k in range(len(expected) // seq_len - 2):  # crosses several epochs
        index, _, read = next(samples)
        assert index == k
        np.testing.assert_array_equal(read(), expected[k * seq_len : (k + 1) * seq_len + 1])


def write_corpus_in_every_format(folder) -> list[str]:
    """Files of each format (row groups of 2 rows in the .parquet file); returns their documents."""
    import pyarrow
    import pyarrow.parquet as pq

    (folder / "a.txt").write_text(DOCS[2])
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n\n" for d in DOCS))
    (folder / "c.txt").write_text("one more file")
    pq.write_table(pyarrow.table({"text": DOCS[::-1]}), folder / "d.parquet", row_group_size=2)
    return [DOCS[2], *DOCS, "one more file", *DOCS[::-1]]


@pytest.mark.parametrize("kind", ["list", "files"])
def test_stream_restarts_from_any_recorded_position(kind, tmp_path):
    tokenizer = ByteTokenizer()
    if kind == "files":
        write_corpus_in_every_format(tmp_path)
        source = TextFiles(find_text_files(str(tmp_path)), "text")
    else:
        source = ListSource(DOCS)
    stream = PackedTextStream(source, tokenizer, 5)
    samples = zip(stream.samples(0, 0, START), range(150))
    reference = [(k, pos, read().copy()) for (k, pos, read), _ in samples]
    for anchor in (0, 3, 17, 31, 44, 90, 121):
        _, position, _ = reference[anchor]
        for (k, pos, read), (k_ref, pos_ref, tokens) in zip(
            stream.samples(anchor + 2, anchor * 5, position), reference[anchor + 2 :]
        ):
            assert (k, pos) == (k_ref, pos_ref)
            np.testing.assert_array_equal(read(), tokens)


@pytest.mark.parametrize(
    "docs, expected",
    [([], "no documents"), ([""] * 3, "only empty documents, 3 of them"), ([""] * 50, "50 of them")],
)
def test_a_dataset_without_text_is_an_error_before_any_sample(docs, expected):
    # 50 empty documents would fill 10 samples of EOS alone: none is read before the error.
    stream = PackedTextStream(ListSource(docs), ByteTokenizer(), 4)
    with pytest.raises(UserError, match=re.escape(expected)):
        next(stream.samples(0, 0, START))


def test_token_ids_outside_the_vocabulary_are_an_error():
    class WideTokenizer(ByteTokenizer):
        def encode_batch(self, texts):
            return [[300 if t == "x" else 97 for t in text] for text in texts]

    stream = PackedTextStream(ListSource(["aaa", "axa"]), WideTokenizer(), 2)
    with pytest.raises(UserError, match="token id 300 for document 1, outside its vocabulary of 258"):
        list(zip(stream.samples(0, 0, START), range(10)))


def step_sample_ids(dataset: GlobalSampleOrder, steps: int, per_rank: int) -> list[list[int]]:
    it = iter(dataset)
    return [[next(it)["sample_id"] for _ in range(per_rank)] for _ in range(steps)]


@pytest.mark.parametrize("dp_degree", [1, 2, 4])
def test_steps_read_consecutive_global_samples_split_over_ranks(dp_degree):
    global_batch, steps = 8, 4
    per_rank = global_batch // dp_degree
    source = build_source(training_config(), ByteTokenizer())
    ranks = [
        step_sample_ids(GlobalSampleOrder(source, 16, global_batch, r, dp_degree), steps, per_rank)
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
    whole = run_steps(GlobalSampleOrder(source, 16, global_batch, 0, 1), 5, 8)
    # Interrupted after 2 steps on dp 2; every rank holds the same state.
    first = [GlobalSampleOrder(source, 16, global_batch, r, 2) for r in range(2)]
    for dataset in first:
        run_steps(dataset, 2, 4)
    states = [d.state_dict() for d in first]
    assert states[0] == states[1] and states[0]["cursor"] == 16
    # Resumed on dp 4.
    resumed = [GlobalSampleOrder(source, 16, global_batch, r, 4) for r in range(4)]
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
    dataset = GlobalSampleOrder(build_source(training_config(), ByteTokenizer()), 16, 4, 0, 1)
    it = iter(dataset)
    next(it)
    with pytest.raises(RuntimeError, match="between optimizer steps"):
        dataset.state_dict()


def test_changed_seq_len_continues_at_the_same_token():
    source = build_source(training_config(), ByteTokenizer())
    old = GlobalSampleOrder(source, 16, 4, 0, 1)
    run_steps(old, 3, 4)  # 12 samples of 16 tokens = token 192
    longer = GlobalSampleOrder(
        build_source(training_config("--training.seq_len", "32"), ByteTokenizer()), 32, 4, 0, 1
    )
    longer.load_state_dict(old.state_dict())
    assert next(iter(longer))["sample_id"] == 6  # token 192 / 32


def test_step_loader_round_trip():
    training = training_config()  # local batch 2, global batch 4: 2 micro-batches per step
    loader = build_dataloader(training, ByteTokenizer(), global_batch_size=4, dp_rank=0, dp_degree=1)
    for _ in range(3):
        loader.next_step()
    state = loader.state_dict()
    expected = loader.next_step() + loader.next_step()
    fresh = build_dataloader(training, ByteTokenizer(), global_batch_size=4, dp_rank=0, dp_degree=1)
    fresh.load_state_dict(state)
    got = fresh.next_step() + fresh.next_step()
    assert [b["sample_ids"].tolist() for b in got] == [[12, 13], [14, 15], [16, 17], [18, 19]]
    for a, b in zip(got, expected):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["labels"], b["labels"])
        assert torch.equal(a["sample_ids"], b["sample_ids"])
    assert got[0]["input"].shape == (2, 16)
    assert torch.equal(got[0]["input"][:, 1:], got[0]["labels"][:, :-1])  # labels are inputs shifted


def test_multi_token_prediction_labels_are_the_tokens_further_ahead():
    """With 2 tokens ahead a micro-batch's labels are (batch, 3, seq): row d the tokens d + 1 after
    the input's, row 0 the labels without them; the input and the data state do not change."""
    training = training_config()
    plain = build_dataloader(training, ByteTokenizer(), global_batch_size=4, dp_rank=0, dp_degree=1)
    ahead = build_dataloader(training, ByteTokenizer(), 4, 0, 1, extra_tokens=2)
    for _ in range(2):
        for a, b in zip(plain.next_step(), ahead.next_step()):
            assert b["labels"].shape == (2, 3, 16) and torch.equal(a["input"], b["input"])
            assert torch.equal(b["labels"][:, 0], a["labels"])
            assert torch.equal(b["labels"][:, 1, :-1], b["labels"][:, 0, 1:])  # one token further on
            assert torch.equal(b["labels"][:, 2, :-1], b["labels"][:, 1, 1:])
    assert plain.state_dict() == ahead.state_dict()


def test_text_files_in_every_format(tmp_path):
    import pyarrow
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"body": "json one"}) + "\n\n" + json.dumps({"body": "json two"}) + "\n"
    )
    pq.write_table(pyarrow.table({"body": ["parquet one", "parquet two"]}), tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("not read")
    source = build_document_source("text", str(tmp_path), "body", "", "train")
    documents = list(source.documents())
    assert [text for _, text in documents] == [
        "plain text file", "json one", "json two", "parquet one", "parquet two"
    ]  # fmt: skip
    # Positions: [file, byte offset, last piece], [file, byte offset, line number], [file, row group, row].
    assert [position for position, _ in documents] == [[0, 0, 1], [1, 0, 1], [1, 22, 3], [2, 0, 0], [2, 0, 1]]
    assert [text for _, text in source.documents([1, 22, 3])] == ["json two", "parquet one", "parquet two"]
    assert [p.name for p in find_text_files(str(tmp_path / "*.jsonl"))] == ["b.jsonl"]


def count_documents_decoded(monkeypatch) -> dict[str, int]:
    """Counts .txt pieces and .jsonl lines decoded and .parquet rows decoded from now on."""
    import pyarrow.parquet as pq

    import data.sources

    counts = {"decoded": 0}

    def counting(function, count):
        def wrapper(*args, **kwargs):
            result = function(*args, **kwargs)
            counts["decoded"] += count(result)
            return result

        return wrapper

    monkeypatch.setattr(data.sources, "_decode", counting(data.sources._decode, lambda _: 1))

    def counting_batches(self, *args, **kwargs):
        for batch in original_batches(self, *args, **kwargs):
            counts["decoded"] += batch.num_rows
            yield batch

    original_batches = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting_batches)
    return counts


def test_restarting_a_source_reads_nothing_before_the_position(tmp_path, monkeypatch):
    texts = write_corpus_in_every_format(tmp_path)
    source = TextFiles(find_text_files(str(tmp_path)), "text")
    documents = list(source.documents())
    assert [text for _, text in documents] == texts
    counts = count_documents_decoded(monkeypatch)
    for index, (position, _) in enumerate(documents):
        counts["decoded"] = 0
        assert [text for _, text in source.documents(position)] == texts[index:]
        # A .parquet row group is decoded from its start: rows before the position within it count.
        rows_before_in_group = position[2] if source.files[position[0]].suffix == ".parquet" else 0
        assert counts["decoded"] == len(texts) - index + rows_before_in_group


def test_resume_deep_in_a_large_corpus_parses_only_what_it_reads(tmp_path, monkeypatch):
    count = 100_000
    # Each document is 15 bytes + EOS = 16 tokens = one sample of seq_len 16: sample k starts document k.
    (tmp_path / "corpus.jsonl").write_text("".join(f'{{"text": "document {i:06d}"}}\n' for i in range(count)))
    training = training_config("--training.dataset", "text", "--training.dataset_path", str(tmp_path))
    loader = build_dataloader(training, ByteTokenizer(), global_batch_size=4, dp_rank=0, dp_degree=1)
    resume_at = count - 10
    # The position the first run recorded for document `resume_at` (that run read everything).
    source = build_document_source("text", str(tmp_path), "text", "", "train")
    position = next(p for i, (p, _) in enumerate(source.documents()) if i == resume_at)
    state = {**loader.state_dict(), "cursor": resume_at, "anchor_token": resume_at * 16}
    state["anchor_position"] = [0, position, 0]
    loader.load_state_dict(state)  # reads nothing yet: reading restarts at the first step
    counts = count_documents_decoded(monkeypatch)
    batches = loader.next_step()
    assert counts["decoded"] == 10  # documents resume_at to the end of the file, and none before
    assert [i for b in batches for i in b["sample_ids"].tolist()] == list(range(resume_at, resume_at + 4))
    assert ByteTokenizer().decode(batches[0]["input"][0].tolist()) == f"document {resume_at:06d}"


def test_checkpoints_with_document_indices_still_load(caplog):
    """Data states written before positions were source-specific hold [epoch, document, offset]."""
    source = build_source(training_config(), ByteTokenizer())
    order = GlobalSampleOrder(source, 16, 4, 0, 1)
    reference = [s["tokens"] for _, s in zip(range(8), order)]
    # Sample 4 = token 64 of the sample corpus, which is inside its first document.
    old_format = {**order.state_dict(), "cursor": 4, "anchor_token": 60, "anchor_position": [0, 0, 60]}
    resumed = GlobalSampleOrder(source, 16, 4, 0, 1)
    resumed.load_state_dict(old_format)
    assert all(torch.equal(a["tokens"], b) for a, b in zip(resumed, reference[4:8]))
    # Deeper: the start of document 3, found by counting documents, with a warning.
    tokenizer = ByteTokenizer()
    lengths = [len(tokenizer.encode(t)) + 1 for _, t in source.source.documents()]
    start = sum(lengths[:3])
    cursor = -(-start // 16)
    old_format.update(cursor=cursor, anchor_token=start, anchor_position=[0, 3, 0])
    with caplog.at_level("WARNING"):
        resumed.load_state_dict(old_format)
    assert "document index (3)" in caplog.text
    fresh = GlobalSampleOrder(source, 16, 4, 0, 1)
    fresh.cursor = cursor  # the same samples, read from the start of the stream
    for a, b, _ in zip(resumed, fresh, range(8)):
        assert torch.equal(a["tokens"], b["tokens"])


def test_hf_stream_restarts_from_its_own_state(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    (tmp_path / "data").mkdir()
    for name, docs in (("a", DOCS), ("b", DOCS[::-1])):
        lines = [json.dumps({"text": d}) + "\n" for d in docs]
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(lines))
    source = build_document_source("hf", str(tmp_path / "data"), "text", "", "train")
    documents = list(source.documents())
    assert [text for _, text in documents] == DOCS + DOCS[::-1]
    assert all(isinstance(position, str) for position, _ in documents)  # JSON: plain, the same on every rank
    for index in (1, 4, 7):
        assert [text for _, text in source.documents(documents[index][0])] == (DOCS + DOCS[::-1])[index:]


def test_source_errors(tmp_path):
    with pytest.raises(UserError, match="names no .txt, .jsonl or .parquet files"):
        find_text_files(str(tmp_path / "nothing*"))
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    source = build_document_source("text", str(tmp_path), "text", "", "train")
    with pytest.raises(UserError, match="has no field 'text'"):
        list(source.documents())


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
    for (k, _, read), _ in zip(stream.samples(0, 0, START), range(300)):
        np.testing.assert_array_equal(shards.sample(k), read())
    # Multi-token prediction's tokens ahead: each sample runs 2 tokens on, the same from either source.
    ahead = PackedTextStream(
        build_document_source("python_docs", "", "text", "", "train"), ByteTokenizer(), 64, 2
    )
    for (k, _, read), _ in zip(ahead.samples(0, 0, START), range(300)):
        window = read()
        np.testing.assert_array_equal(window, TokenShards(str(output), 64, extra_tokens=2).sample(k))
        np.testing.assert_array_equal(window[:65], shards.sample(k))
        assert len(window) == 67
    # A state saved reading the shards (in order) holds no stream position; the text stream
    # continues from it, at the same sample.
    from_shards = GlobalSampleOrder(ShardMixture([str(output)], [1.0], 64, 0, False, 0), 64, 4, 0, 1)
    run_steps(from_shards, 3, 4)
    assert json.loads(from_shards.state_dict()["data"])["kind"] == "tokens"
    text = GlobalSampleOrder(stream, 64, 4, 0, 1)
    text.load_state_dict(from_shards.state_dict())
    for (a, b), _ in zip(zip(text, from_shards), range(8)):
        assert a["sample_id"] == b["sample_id"] and torch.equal(a["tokens"], b["tokens"])
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


def test_a_checkpoint_of_another_tokenizer_is_refused_unless_allowed(hf_assets):
    bytes_run = build_dataloader(training_config(), ByteTokenizer(), 4, 0, 1)
    bytes_run.next_step()
    state = bytes_run.state_dict()
    assert state["tokenizer"] == "bytes"
    hf = build_tokenizer(str(hf_assets))
    assert hf.identity.startswith("sha256:") and len(hf.identity) == 71
    refusal = r"trained with another tokenizer \(bytes\.\.\.\) than this run's \(sha256:"
    with pytest.raises(UserError, match=refusal):
        build_dataloader(training_config(), hf, 4, 0, 1).load_state_dict(state)
    allowed = build_dataloader(training_config("--training.allow_tokenizer_change"), hf, 4, 0, 1)
    allowed.load_state_dict(state)
    assert allowed.next_step()[0]["sample_ids"].tolist() == [4, 5]
    older = {k: v for k, v in state.items() if k not in ("tokenizer", "data")}  # written before both
    build_dataloader(training_config(), hf, 4, 0, 1).load_state_dict(older)
