"""Mixtures of token-shard sources: the weighted schedule, shuffling, exact resume, accounting,
reading ahead and the mistakes users make with them (data/mixture.py, data/prefetch.py)."""

import json
import logging

import numpy as np
import pytest
import torch
from conftest import write_mixture, write_token_source

from configs import UserError, load_config
from data.loader import GlobalSampleOrder, build_dataloader, build_source
from data.mixture import Permutation, next_source
from data.tokenizer import ByteTokenizer

SEQ = 8
WEIGHTS = [[0.6, 0.3, 0.1], [0.5, 0.5], [0.7, 0.2, 0.05, 0.05], [1 / 3] * 3, [0.99, 0.01], [0.25, 0.0, 0.75]]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_each_source_stays_within_one_of_its_share_and_two_over_any_window(weights):
    drawn, history = [0] * len(weights), [[0] * len(weights)]
    for n in range(6000):
        drawn[next_source(weights, drawn, n)] += 1
        history.append(list(drawn))
        for i, weight in enumerate(weights):
            assert abs(drawn[i] - weight * (n + 1)) < 1, (n, i)
    counts = np.array(history)
    generator = np.random.default_rng(0)
    for _ in range(2000):
        a, b = sorted(generator.integers(0, len(history), 2))
        assert np.all(np.abs(counts[b] - counts[a] - np.array(weights) * (b - a)) < 2), (a, b)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_permutation_is_a_bijection_that_depends_on_its_key(n):
    order = [Permutation(n, "seed/web/0")(i) for i in range(n)]
    assert sorted(order) == list(range(n))
    if n >= 100:
        assert order != list(range(n))
        assert order != [Permutation(n, "seed/web/1")(i) for i in range(n)]


def test_permutation_of_a_huge_source_needs_no_table():
    n = 1_220_703_125  # 10 trillion tokens in samples of 8192
    permutation = Permutation(n, "0/web/0")
    assert permutation.mask == (1 << 16) - 1  # two halves of 16 bits: the state is 4 keys
    values = [permutation(i) for i in range(0, n, n // 2000)]
    assert all(0 <= v < n for v in values) and len(set(values)) == len(values)


def mixture_config(folders, *argv):
    paths = ",".join(map(str, folders))
    argv = ["--training.dataset", "tokens", "--training.dataset_path", paths, "--training.seq_len", str(SEQ),
            "--training.local_batch_size", "2", *argv]  # fmt: skip
    return load_config(argv).training


@pytest.fixture
def three_sources(tmp_path):
    # 'small' holds 5 samples of 8 (+1) tokens: it runs through several epochs.
    return write_mixture(tmp_path, {"web": 8 * 200 + 1, "code": 8 * 60 + 1, "small": 8 * 5 + 1})


def samples_of(folders):
    """Each sample of each source, by its tokens: (source name, index)."""
    found = {}
    for folder in folders:
        tokens = np.fromfile(folder / "tokens-00000.bin", dtype=np.uint16).astype(np.int64)
        for index in range((len(tokens) - 1) // SEQ):
            found[tuple(tokens[index * SEQ : index * SEQ + SEQ + 1])] = (folder.name, index)
    return found


def read_steps(order: GlobalSampleOrder, steps: int) -> list[list[tuple[int, torch.Tensor]]]:
    per_rank, it = order.global_batch_size // order.dp_degree, iter(order)
    return [
        [(s["sample_id"], s["tokens"]) for s in (next(it) for _ in range(per_rank))] for _ in range(steps)
    ]


def test_sources_are_read_by_weight_each_epoch_a_new_permutation(three_sources, caplog):
    source = build_source(
        mixture_config(three_sources, "--training.dataset_weights", "6,3,1"), ByteTokenizer()
    )
    lookup = samples_of(three_sources)
    with caplog.at_level(logging.INFO, logger="data.mixture"):
        read = [
            lookup[tuple(s.tolist())]
            for step in read_steps(GlobalSampleOrder(source, SEQ, 10, 0, 1), 30)
            for _, s in step
        ]
    names = [name for name, _ in read]
    assert [names.count(n) for n in ("web", "code", "small")] == [180, 90, 30]
    small = [index for name, index in read if name == "small"]
    epochs = [small[e * 5 : e * 5 + 5] for e in range(6)]
    assert all(sorted(e) == list(range(5)) for e in epochs)  # each epoch reads every sample once
    code = [index for name, index in read if name == "code"][:60]
    assert sorted(code) == list(range(60)) and code != list(range(60))  # shuffled
    assert len({tuple(e) for e in epochs}) > 1  # another permutation each epoch
    messages = [r.getMessage() for r in caplog.records]
    assert sum("'small' starts epoch 2" in m for m in messages) == 1
    assert any("'small' starts epoch 5" in m and "read 4 times" in m for m in messages)
    # Off: each source in its order on disk.
    unshuffled = build_source(mixture_config(three_sources, "--training.shuffle", "false"), ByteTokenizer())
    read = [
        lookup[tuple(s.tolist())]
        for step in read_steps(GlobalSampleOrder(unshuffled, SEQ, 10, 0, 1), 3)
        for _, s in step
    ]
    assert [index for name, index in read if name == "web"] == list(range(10))


def test_resume_on_other_data_parallel_degrees_reads_the_same_samples(three_sources):
    config = mixture_config(three_sources, "--training.dataset_weights", "0.5,0.3,0.2")
    source = lambda: build_source(config, ByteTokenizer(), seed=7)
    whole = read_steps(GlobalSampleOrder(source(), SEQ, 8, 0, 1), 9)
    first = [GlobalSampleOrder(source(), SEQ, 8, r, 2) for r in range(2)]
    for order in first:
        read_steps(order, 4)
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["cursor"] == 32
    resumed = [GlobalSampleOrder(source(), SEQ, 8, r, 4) for r in range(4)]
    for order in resumed:
        order.load_state_dict(json.loads(json.dumps(state)))  # what a checkpoint holds
    per_rank = [read_steps(order, 5) for order in resumed]
    for step in range(5):
        got = [sample for r in range(4) for sample in per_rank[r][step]]
        assert [k for k, _ in got] == [k for k, _ in whole[4 + step]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, whole[4 + step]))
    assert resumed[0].counts() == GlobalSampleOrder(source(), SEQ, 8, 0, 1).source.counts([0, 0, 0, 0], 72)


def test_a_state_from_before_mixtures_continues_its_source_in_order(three_sources, caplog):
    config = mixture_config(three_sources[:1])
    order = GlobalSampleOrder(build_source(config, ByteTokenizer()), SEQ, 4, 0, 1)
    old_state = {
        "cursor": 12,
        "seq_len": SEQ,
        "global_batch_size": 4,
        "anchor_token": 12 * SEQ,
        "anchor_position": None,
    }
    with caplog.at_level(logging.INFO, logger="data.mixture"):
        order.load_state_dict(old_state)
    assert "predates shuffling" in caplog.text
    lookup = samples_of(three_sources[:1])
    assert [lookup[tuple(s.tolist())][1] for _, s in read_steps(order, 2)[1]] == [16, 17, 18, 19]


def test_changed_weights_are_refused_unless_allowed_then_each_source_continues(three_sources, caplog):
    before = GlobalSampleOrder(build_source(mixture_config(three_sources), ByteTokenizer()), SEQ, 6, 0, 1)
    read_steps(before, 5)
    state = before.state_dict()
    given = before.counts()["source_samples"]
    assert given == {"web": 10, "code": 10, "small": 10}
    other = mixture_config(three_sources, "--training.dataset_weights", "1,1,0")
    expected = r"data differs from this run's \('web' weight 0.3333 there, 0.5 here; .*'small' weight 0.3333 "
    with pytest.raises(UserError, match=expected + r"there, 0 here\).*allow_data_change"):
        GlobalSampleOrder(build_source(other, ByteTokenizer()), SEQ, 6, 0, 1).load_state_dict(state)
    allowed = mixture_config(
        three_sources, "--training.dataset_weights", "1,1,0", "--training.allow_data_change"
    )
    after = GlobalSampleOrder(build_source(allowed, ByteTokenizer()), SEQ, 6, 0, 1)
    with caplog.at_level(logging.WARNING, logger="data.mixture"):
        after.load_state_dict(state)
    assert "'web' from sample 10" in caplog.text
    lookup = samples_of(three_sources)
    continued = [lookup[tuple(s.tolist())] for _, s in read_steps(after, 1)[0]]
    uninterrupted = GlobalSampleOrder(
        build_source(mixture_config(three_sources), ByteTokenizer()), SEQ, 6, 0, 1
    )
    later = [lookup[tuple(s.tolist())] for step in read_steps(uninterrupted, 10)[5:] for _, s in step]
    # Each source goes on with its own next samples, in the same permutation.
    assert [x for x in continued if x[0] == "web"] == [x for x in later if x[0] == "web"][:3]
    assert after.counts()["source_samples"] == {"web": 13, "code": 13, "small": 10}


def test_reading_ahead_gives_the_same_steps_and_states_and_raises_errors_as_they_were(three_sources):
    config = mixture_config(three_sources, "--training.dataset_weights", "0.5,0.3,0.2")
    loaders = [build_dataloader(config, ByteTokenizer(), 8, 1, 2, prefetch_steps=p) for p in (0, 3)]
    for _ in range(6):
        steps = [loader.next_step() for loader in loaders]
        for a, b in zip(*steps):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert loaders[0].state_dict() == loaders[1].state_dict()
    accounting = [loader.accounting() for loader in loaders]
    assert accounting[0]["source_samples"] == accounting[1]["source_samples"]
    assert sum(accounting[0]["source_samples"].values()) == 48 and accounting[1]["data_wait_ms"] >= 0
    # A resume replaces what was read ahead.
    state = loaders[0].state_dict()
    loaders[1].next_step()
    loaders[1].load_state_dict(state)
    assert torch.equal(loaders[1].next_step()[0]["input"], loaders[0].next_step()[0]["input"])
    for loader in loaders:
        loader.close()
    # A shard that disappears while reading ahead: the error arrives as raised, at the step that needs it.
    broken = build_dataloader(config, ByteTokenizer(), 8, 0, 1, prefetch_steps=2)
    broken.order.source.sources[0].sample = lambda index: (_ for _ in ()).throw(UserError("shard gone"))
    with pytest.raises(UserError, match="^shard gone$"):
        broken.next_step()
    broken.close()


def test_mixture_mistakes_are_one_line_errors(tmp_path, three_sources):
    cases = [
        (["--training.dataset_weights", "1,2"], "has 2 weights for 3 sources"),
        (["--training.dataset_weights", "1,-1,1"], "must be finite and >= 0"),
        (["--training.dataset_weights", "0,0,0"], "are all zero"),
        (["--training.dataset_weights", "a,b,c"], "is not a list of numbers"),
    ]
    for argv, expected in cases:
        with pytest.raises(UserError, match=expected):
            build_source(mixture_config(three_sources, *argv), ByteTokenizer())
    again = write_token_source(tmp_path / "other" / "web", np.arange(100) % 256)
    with pytest.raises(UserError, match="two sources 'web'"):
        build_source(mixture_config([*three_sources, again]), ByteTokenizer())
    wide = write_token_source(tmp_path / "wide", np.arange(100) % 256, dtype="uint32")
    with pytest.raises(UserError, match="differ in dtype"):
        build_source(mixture_config([three_sources[0], wide]), ByteTokenizer())
    foreign = write_token_source(
        tmp_path / "foreign", np.arange(100) % 256, tokenizer_id="sha256:" + "0" * 64
    )
    with pytest.raises(UserError, match="differ in tokenizer"):
        build_source(mixture_config([three_sources[0], foreign]), ByteTokenizer())
    with pytest.raises(UserError, match="made with another tokenizer"):
        build_source(mixture_config([foreign]), ByteTokenizer())
    assert build_source(mixture_config([foreign], "--training.allow_tokenizer_change"), ByteTokenizer())
    with pytest.raises(UserError, match="has no meta.json"):
        build_source(mixture_config([three_sources[0], tmp_path / "missing"]), ByteTokenizer())
    text = load_config(["--training.dataset_weights", "1"]).training
    with pytest.raises(UserError, match="mixes token-shard folders"):
        build_source(text, ByteTokenizer())
