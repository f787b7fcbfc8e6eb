"""Text sources that could mislead a run (issue 53): links that loop, long .txt files, bytes that are
not UTF-8, a corpus smaller than one sample, a corpus that changed under a checkpoint."""

import json
import logging
import os

import numpy as np
import pytest
import torch

import data.sources
from configs import UserError, load_config
from data.file_search import find_text_files
from data.loader import build_dataloader
from data.packing import START, PackedTextStream, tokenize
from data.sources import TextFiles
from data.tokenizer import ByteTokenizer, build_tokenizer


def training(path, *argv):
    argv = ["--training.dataset", "text", "--training.dataset_path", str(path), "--training.seq_len", "16",
            "--training.local_batch_size", "2", *argv]  # fmt: skip
    return load_config(argv).training


def test_links_are_followed_but_never_around_a_loop(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (corpus / "sub" / "b.txt").write_text("b")
    os.symlink(".", corpus / "latest")  # a loop through one link
    os.symlink(corpus / "sub", corpus / "sub" / "again")  # and one inside a subfolder
    os.symlink(corpus / "sub" / "b.txt", corpus / "b_link.txt")  # one file reached twice
    (tmp_path / "x").mkdir()
    os.symlink(tmp_path / "y", tmp_path / "x" / "to_y")  # two links pointing at each other
    os.symlink(tmp_path / "x", tmp_path / "y")
    for path in (corpus, f"{corpus}/**/*", f"{corpus}/**/*.txt"):
        files = find_text_files(str(path))
        names = sorted(f.name for f in files)
        assert names == (["a.jsonl", "b_link.txt"] if path != f"{corpus}/**/*.txt" else ["b_link.txt"]), path
    with pytest.raises(UserError, match="names no .txt"):
        find_text_files(str(tmp_path / "x"))
    assert [f.name for f in find_text_files(f"{corpus}/*.jsonl")] == ["a.jsonl"]


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("bpe")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator([data.sources.SAMPLE_CORPUS.read_text()[:200_000]], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return build_tokenizer(str(folder))


def test_long_txt_files_are_read_in_pieces_with_the_same_tokens(tmp_path, monkeypatch, byte_level_bpe):
    text = "".join(
        json.loads(line)["text"] for line in data.sources.SAMPLE_CORPUS.read_text().splitlines()[:5]
    )
    text = text.replace("\n", "\r\n", 3) + "  two  spaces \t tab\n\nend"
    (tmp_path / "book.txt").write_bytes(text.encode())
    monkeypatch.setattr(data.sources, "TXT_PIECE_BYTES", 256)
    source = TextFiles([tmp_path / "book.txt"], "text")
    pieces = list(source.documents())
    assert len(pieces) > 20 and all(len(t.encode()) <= 512 for _, t in pieces)
    assert [p[2] for p, _ in pieces] == [0] * (len(pieces) - 1) + [1]
    whole = text.replace("\r\n", "\n")
    assert "".join(t for _, t in pieces) == whole
    for tokenizer in (ByteTokenizer(), byte_level_bpe):
        tokens = np.concatenate([t for _, t in tokenize(source, tokenizer)])
        assert tokens.tolist() == tokenizer.encode(whole) + [tokenizer.eos_id]  # one EOS, at the end
    # A resume at a piece reads the same pieces from there on.
    middle = pieces[len(pieces) // 2][0]
    assert list(source.documents(middle)) == pieces[len(pieces) // 2 :]
    stream = PackedTextStream(source, ByteTokenizer(), 16)
    samples = [
        (k, position, read()) for (k, position, read), _ in zip(stream.samples(0, 0, START), range(60))
    ]
    k, position, tokens = samples[40]
    resumed = next(stream.samples(k, k * 16, position))
    assert resumed[0] == k and np.array_equal(resumed[2](), tokens)


def test_bytes_that_are_not_utf8_are_replaced_alike_with_one_warning_per_file(tmp_path, caplog):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 and \xff\xfe ok \xef\xbf\xbd kept")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "na\xefve"}\n{"text": "fine"}\n{"text": "\xc3"}\n')
    source = TextFiles(find_text_files(str(tmp_path)), "text")
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        texts = [text for _, text in source.documents()]
        list(source.documents())  # a second epoch: no second warning
    assert texts == ["caf\ufffd and \ufffd\ufffd ok \ufffd kept", "na\ufffdve", "fine", "\ufffd"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert warnings[0].endswith(
        "a.txt: 3 bytes are not UTF-8; read as U+FFFD"
    )  # the real U+FFFD is not counted
    assert warnings[1].endswith("b.jsonl: 2 bytes are not UTF-8; read as U+FFFD")


def test_a_corpus_smaller_than_one_sample_is_warned_about(tmp_path, caplog):
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "short"}) + "\n")
    loader = build_dataloader(training(tmp_path), ByteTokenizer(), 2, 0, 1)
    with caplog.at_level(logging.WARNING, logger="data.packing"):
        loader.next_step()
    assert "fewer tokens than one sample (seq_len + 1 = 17)" in caplog.text


def test_a_changed_file_list_is_refused_unless_allowed(tmp_path, caplog):
    for name in ("b", "d"):
        lines = [json.dumps({"text": f"{name} {i} " * 5}) + "\n" for i in range(20)]
        (tmp_path / f"{name}.jsonl").write_text("".join(lines))
    loader = build_dataloader(training(tmp_path), ByteTokenizer(), 2, 0, 1)
    for _ in range(20):  # 640 tokens: into d.jsonl
        loader.next_step()
    state = loader.state_dict()
    expected = loader.next_step()[0]  # what the uninterrupted run reads next
    size = (tmp_path / "b.jsonl").stat().st_size
    assert json.loads(state["data"])["files"] == [["b.jsonl", size], ["d.jsonl", size]]
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "sorts first, new"}) + "\n")
    refusal = r"text data changed since the checkpoint \(added a.jsonl\).*allow_data_change"
    with pytest.raises(UserError, match=refusal):
        build_dataloader(training(tmp_path), ByteTokenizer(), 2, 0, 1).load_state_dict(state)
    allowed = build_dataloader(training(tmp_path, "--training.allow_data_change"), ByteTokenizer(), 2, 0, 1)
    with caplog.at_level(logging.WARNING, logger="data.packing"):
        allowed.load_state_dict(state)
        batch = allowed.next_step()[0]
    assert "continuing at" in caplog.text and "d.jsonl" in caplog.text
    assert torch.equal(batch["input"], expected["input"])  # the same place in d.jsonl, not a.jsonl


def test_a_text_source_says_once_when_it_starts_each_epoch(tmp_path, caplog):
    (tmp_path / "small.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(4))
    )
    loader = build_dataloader(training(tmp_path), ByteTokenizer(), 2, 0, 1)
    with caplog.at_level(logging.INFO, logger="data.packing"):
        for _ in range(20):  # 640 tokens: several epochs of ~130 tokens
            loader.next_step()
    starts = [r.getMessage() for r in caplog.records if "starts epoch" in r.getMessage()]
    assert len(starts) >= 3 and len(starts) == len(set(starts))
    assert starts[0].startswith(f"data source '{tmp_path}' starts epoch 2")
