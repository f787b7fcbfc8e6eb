"""Token-shard sources mixed by weight, each read in a shuffled order: the sample order of
training.dataset = "tokens" (one folder is a mixture of one).

Which source global sample n comes from follows from the weights alone, with no random draw: the
source furthest below its share, argmax_i (w_i (n + 1) - drawn_i), ties to the first. Each source's
count then stays within 1 of w_i x n, and within 2 of w_i x (samples) over any window, and the order
is the same on every layout. A source's j-th sample is sample P_e(j mod N) of its folder, e = j div N
its epoch and N its samples per epoch; P_e is a keyed permutation of range(N) (a Feistel network,
cycle-walked onto the range), different for each seed, source and epoch, computed per index: no
index file, O(1) memory whatever the size. A source that runs out starts its next epoch; the others
go on.

The position of sample n is [n, drawn_0, ..., drawn_{S-1}] (samples each source gave since the
schedule started): restarting there costs nothing. The data state (data_state()) also holds what the
order depends on (sources and their sizes, weights, shuffling, seed) and where the schedule started:
a resume with other sources or weights is refused unless training.allow_data_change, and then each
source continues from the samples it gave (the schedule starts anew at the resumed step). A state
without it (written before mixtures existed) continues its single source unshuffled, in its order.
"""

import hashlib
import logging
from functools import partial
from pathlib import Path

import numpy as np

from configs import UserError
from data.shards import TokenShards

logger = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
WARN_EPOCHS = 4  # a source starting its 5th epoch is warned about: the model may memorize it


class Permutation:
    """A keyed bijection of range(n): four Feistel rounds on the smallest even-bit power of two
    >= n, repeated on values >= n until one falls in range (cycle walking: at most 4 tries on
    average, since the domain is under 4n)."""

    def __init__(self, n: int, key: str):
        self.n = n
        bits = max((n - 1).bit_length(), 2)
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        digest = hashlib.sha256(key.encode()).digest()
        self.keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(4)]

    def _round(self, value: int, key: int) -> int:  # splitmix64's finalizer of value ^ key
        z = (value ^ key) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return (z ^ (z >> 31)) & self.mask

    def __call__(self, index: int) -> int:
        x = index
        while True:
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ self._round(right, key)
            x = (left << self.half) | right
            if x < self.n:
                return x


def next_source(weights: list[float], drawn: list[int], scheduled: int) -> int:
    """The source of the next sample, given the samples each source gave of the `scheduled` so far."""
    best, best_deficit = 0, None
    for i, weight in enumerate(weights):
        deficit = weight * (scheduled + 1) - drawn[i]
        if best_deficit is None or deficit > best_deficit:
            best, best_deficit = i, deficit
    return best


def source_names(folders: list[str]) -> list[str]:
    names = [Path(folder.rstrip("/")).name for folder in folders]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UserError(
            f"training.dataset_path names two sources '{repeated[0]}': sources are named by their "
            "folders' last component, which must differ (rename or link one)"
        )
    return names


def parse_weights(dataset_weights: str, count: int) -> list[float]:
    """training.dataset_weights ("0.6,0.3,0.1"; empty: equal) -> weights summing to 1."""
    if not dataset_weights.strip():
        return [1.0 / count] * count
    try:
        weights = [float(w) for w in dataset_weights.split(",")]
    except ValueError:
        raise UserError(f"training.dataset_weights '{dataset_weights}' is not a list of numbers") from None
    if len(weights) != count:
        raise UserError(
            f"training.dataset_weights has {len(weights)} weights for {count} sources in "
            "training.dataset_path: give one weight per folder"
        )
    if any(w < 0 or w != w or w == float("inf") for w in weights):
        raise UserError(f"training.dataset_weights '{dataset_weights}' must be finite and >= 0")
    if sum(weights) == 0:
        raise UserError("training.dataset_weights are all zero: at least one source must be read")
    return [w / sum(weights) for w in weights]


class ShardMixture:
    """The global sample stream of a weighted, shuffled mixture of token-shard folders, read by
    GlobalSampleOrder (data/loader.py) as it reads a packed text stream."""

    restarts_by_sample = True  # a seq_len change continues each source at its sample count

    def __init__(
        self, folders: list[str], weights: list[float], seq_len: int, extra_tokens: int, shuffle: bool,
        seed: int, allow_change: bool = False,
    ):  # fmt: skip
        self.names = source_names(folders)
        self.sources = [TokenShards(folder, seq_len, extra_tokens) for folder in folders]
        self.weights = weights
        self.shuffle, self.seed, self.allow_change = shuffle, seed, allow_change
        for name, weight in zip(self.names, weights):
            if weight == 0:
                logger.warning(f"data source '{name}' has weight 0: it is never read")
        self.start = [0] * (1 + len(self.sources))
        # The schedule's start: the global sample where these weights began, and the samples each
        # source had given before it (both 0 unless a resume changed the data).
        self.schedule_start = 0
        self.before = [0] * len(self.sources)
        self._permutations: dict[tuple[int, int], Permutation] = {}
        self._announced: set[tuple[int, int]] = set()

    @property
    def vocab_size(self) -> int:
        return self.sources[0].vocab_size

    def describe(self) -> dict:
        """What the order depends on (compared on resume)."""
        return {
            "kind": "tokens",
            "sources": [
                {"name": name, "weight": weight, "tokens": source.num_tokens}
                for name, weight, source in zip(self.names, self.weights, self.sources)
            ],
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def summary(self) -> str:
        """One line for the start-up log: the sources, their weights and sizes, the order."""
        order = f"shuffled (job.seed {self.seed})" if self.shuffle else "in order"
        parts = [
            f"{name} {100 * weight:.3g}% ({source.num_tokens:,} tokens)"
            for name, weight, source in zip(self.names, self.weights, self.sources)
        ]
        what = "a token-shard source" if len(parts) == 1 else f"{len(parts)} token-shard sources"
        return f"{what}, {order}: {', '.join(parts)}"

    def data_state(self) -> dict:
        return {**self.describe(), "schedule_start": self.schedule_start, "before": list(self.before)}

    # -- the order ---------------------------------------------------------------------------

    def samples(self, first_sample: int, anchor_token: int, anchor: list[int]):
        """(n, position of sample n, a function reading its tokens) for n >= first_sample, walking
        the schedule from the anchor position (at or before first_sample); reads only on call."""
        n, drawn = anchor[0], list(anchor[1:])
        while True:
            i = next_source(self.weights, drawn, n - self.schedule_start)
            if n >= first_sample:
                yield n, [n, *drawn], partial(self._read, i, self.before[i] + drawn[i])
            drawn[i] += 1
            n += 1

    def _read(self, source: int, j: int) -> np.ndarray:
        shards = self.sources[source]
        epoch, index = divmod(j, shards.samples_per_epoch)
        if index == 0 and epoch > 0 and (source, epoch) not in self._announced:
            self._announced.add((source, epoch))
            read = "" if epoch != WARN_EPOCHS else (
                f"; it has now been read {epoch} times: give it a smaller weight or more data "
                "(repeated data is memorized)"
            )  # fmt: skip
            log = logger.warning if epoch == WARN_EPOCHS else logger.info  # warned about once
            log(f"data source '{self.names[source]}' starts epoch {epoch + 1} ({j:,} samples read){read}")
        if self.shuffle:
            index = self._permutation(source, epoch)(index)
        return shards.sample(index)

    def _permutation(self, source: int, epoch: int) -> Permutation:
        key = (source, epoch)
        if key not in self._permutations:
            if len(self._permutations) > 64:  # epochs long past
                self._permutations.clear()
            n = self.sources[source].samples_per_epoch
            self._permutations[key] = Permutation(n, f"{self.seed}/{self.names[source]}/{epoch}")
        return self._permutations[key]

    def counts(self, anchor: list[int], cursor: int) -> dict[str, dict[str, int]]:
        """Samples read from each source and the epoch each is in, at global sample `cursor`."""
        total = self._given(anchor, cursor)
        return {
            "source_samples": dict(zip(self.names, total)),
            "source_epochs": {
                name: 1 + t // s.samples_per_epoch for name, t, s in zip(self.names, total, self.sources)
            },
        }

    def _given(self, anchor: list[int], cursor: int) -> list[int]:
        """The samples each source has given before global sample cursor (walked from anchor)."""
        n, drawn = anchor[0], list(anchor[1:])
        while n < cursor:
            drawn[next_source(self.weights, drawn, n - self.schedule_start)] += 1
            n += 1
        return [b + d for b, d in zip(self.before, drawn)]

    # -- resume ------------------------------------------------------------------------------

    def restart_point(self, anchor_token: int, saved_anchor, saved_data: dict | None, cursor: int):
        """(anchor token, position) to continue from a saved state at global sample cursor."""
        if saved_data is None or saved_data.get("kind") != "tokens":
            return anchor_token, self._restart_without_description(saved_data, cursor)
        theirs, ours = _comparable(saved_data), _comparable(self.describe())
        if theirs == ours:
            self.schedule_start, self.before = saved_data["schedule_start"], list(saved_data["before"])
            return anchor_token, list(saved_anchor)
        differences = _differences(theirs, ours)
        if not self.allow_change:
            raise UserError(
                f"the checkpoint's data differs from this run's ({differences}): the order would not "
                "continue; to change the data on purpose set training.allow_data_change (each source "
                "then continues from the samples it gave)"
            )
        # Each source continues from the samples it gave; the new weights schedule from here on.
        saved = ShardMixture.__new__(ShardMixture)  # the saved schedule, walked to the cursor
        saved.weights = [s["weight"] for s in saved_data["sources"]]
        saved.schedule_start, saved.before = saved_data["schedule_start"], list(saved_data["before"])
        given = dict(zip([s["name"] for s in saved_data["sources"]], saved._given(saved_anchor, cursor)))
        self.before = [given.get(name, 0) for name in self.names]
        self.schedule_start = cursor
        continued = ", ".join(
            f"'{name}' from sample {given:,}" for name, given in zip(self.names, self.before)
        )
        logger.warning(
            f"the data changed since the checkpoint ({differences}); as training.allow_data_change "
            f"asks, each source continues from the samples it gave: {continued}"
        )
        return anchor_token, [cursor, *[0] * len(self.sources)]

    def _restart_without_description(self, saved_data: dict | None, cursor: int) -> list[int]:
        """A state written before mixtures (one source read in order), or while reading text."""
        if saved_data is None and len(self.sources) == 1:
            if self.shuffle:
                logger.info("the checkpoint predates shuffling: its source continues in its order")
            self.shuffle = False
            self.schedule_start, self.before = 0, [0]
            return [cursor, cursor]
        what = "a text source" if saved_data is not None else "one token-shard source read in order"
        if not self.allow_change:
            raise UserError(
                f"the checkpoint was written reading {what}, not this mixture; to change the data on "
                "purpose set training.allow_data_change (every source then starts from its beginning)"
            )
        logger.warning(f"the checkpoint was written reading {what}: every source starts from its beginning")
        self.schedule_start, self.before = cursor, [0] * len(self.sources)
        return [cursor, *[0] * len(self.sources)]


def _comparable(description: dict) -> dict:
    return {key: description[key] for key in ("sources", "shuffle", "seed")}


def _differences(theirs: dict, ours: dict) -> str:
    found = []
    their_sources = {s["name"]: s for s in theirs["sources"]}
    our_sources = {s["name"]: s for s in ours["sources"]}
    if list(their_sources) != list(our_sources):
        found.append(f"sources {', '.join(their_sources)} there, {', '.join(our_sources)} here")
    for name in [n for n in our_sources if n in their_sources]:
        a, b = their_sources[name], our_sources[name]
        if a["weight"] != b["weight"]:
            found.append(f"'{name}' weight {a['weight']:.4g} there, {b['weight']:.4g} here")
        if a["tokens"] != b["tokens"]:
            found.append(f"'{name}' {a['tokens']:,} tokens there, {b['tokens']:,} here")
    for key in ("shuffle", "seed"):
        if theirs[key] != ours[key]:
            found.append(f"{key} {theirs[key]} there, {ours[key]} here")
    return "; ".join(found)
