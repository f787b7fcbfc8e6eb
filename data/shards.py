"""Token shards: the pretokenized format written by scripts/prepare_data.py, read memory-mapped.

A folder holds meta.json and raw little-endian token files (uint16 when the vocabulary fits, else
uint32). The files together are one token stream; sample k is tokens [k*L, k*L + L] of it, read
directly, so every rank reads only its own samples. The order in which samples are read (mixtures,
shuffling, epochs) is data/mixture.py's.
"""

import json
from pathlib import Path

import numpy as np

from configs import UserError

FORMAT = "recipe-token-shards-v1"


def write_meta(
    folder: Path, dtype: str, vocab_size: int, eos_id: int, tokenizer: str, tokenizer_id: str,
    shards: list[dict],
) -> None:  # fmt: skip
    meta = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer": tokenizer,  # where it came from (model.hf_assets_path), for people
        "tokenizer_id": tokenizer_id,  # what it is (data/tokenizer.py identity), checked on use
        "shards": shards,  # [{"file": "tokens-00000.bin", "num_tokens": N}, ...]
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


class TokenShards:
    def __init__(self, folder: str, seq_len: int, extra_tokens: int = 0):
        """extra_tokens: read this many tokens past each sample's labels too (multi-token
        prediction's tokens ahead, data/loader.py)."""
        meta_path = Path(folder) / "meta.json"
        if not meta_path.is_file():
            raise UserError(
                f"training.dataset_path '{folder}' has no meta.json; "
                "write token shards with scripts/prepare_data.py"
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise UserError(f"{meta_path} is not a {FORMAT} file (format: {meta.get('format')!r})")
        self.meta = meta
        self.vocab_size = meta["vocab_size"]
        self.seq_len, self.extra_tokens = seq_len, extra_tokens
        self.arrays = []
        for shard in meta["shards"]:
            path = Path(folder) / shard["file"]
            expected = shard["num_tokens"] * np.dtype(meta["dtype"]).itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise UserError(f"token shard {path} is missing or truncated (expected {expected} bytes)")
            if shard["num_tokens"]:
                self.arrays.append(np.memmap(path, dtype=meta["dtype"], mode="r"))
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        self.num_tokens = int(self.offsets[-1])
        self.samples_per_epoch = (self.num_tokens - 1 - extra_tokens) // seq_len
        if self.samples_per_epoch < 1:
            raise UserError(
                f"training.dataset_path '{folder}' holds {self.num_tokens} tokens, fewer than one "
                f"sample of seq_len {seq_len} + {1 + extra_tokens}"
            )

    def sample(self, k: int) -> np.ndarray:
        start = (k % self.samples_per_epoch) * self.seq_len
        return self._tokens(start, start + self.seq_len + 1 + self.extra_tokens)

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            local = start - self.offsets[shard]
            take = min(stop - start, len(self.arrays[shard]) - local)
            pieces.append(self.arrays[shard][local : local + take])
            start += take
            shard += 1
        return np.concatenate(pieces).astype(np.int64)


def check_tokenizer(sources: dict[str, "TokenShards"], tokenizer, allow_change: bool = False) -> None:
    """The sources agree on the tokenizer and dtype, and it is the run's (model.hf_assets_path):
    the same vocabulary size, and the same tokenizer file (its hash, recorded in meta.json since
    tokenizer identities exist; training.allow_tokenizer_change accepts another)."""
    names = list(sources)
    first = sources[names[0]].meta
    for name in names[1:]:
        meta = sources[name].meta
        for key, what in (
            ("dtype", "dtype"),
            ("vocab_size", "vocabulary size"),
            ("tokenizer_id", "tokenizer"),
        ):
            if meta.get(key) != first.get(key) and (key != "tokenizer_id" or not allow_change):
                raise UserError(
                    f"token-shard sources '{names[0]}' and '{name}' differ in {what} ({first.get(key)} "
                    f"and {meta.get(key)}): prepare every source with the same tokenizer"
                )
    if first["vocab_size"] != tokenizer.vocab_size:
        raise UserError(
            f"the token shards of '{names[0]}' were made with a tokenizer of {first['vocab_size']} "
            f"tokens ({first['tokenizer']}), but model.hf_assets_path gives one of {tokenizer.vocab_size}"
        )
    recorded = first.get("tokenizer_id")  # absent in shards written before identities
    if recorded is not None and recorded != tokenizer.identity and not allow_change:
        raise UserError(
            f"the token shards of '{names[0]}' were made with another tokenizer ({first['tokenizer']}, "
            f"{recorded[:19]}...) than model.hf_assets_path's ({tokenizer.identity[:19]}...) of the "
            "same vocabulary size; set training.allow_tokenizer_change to train on them anyway"
        )
