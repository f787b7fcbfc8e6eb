"""Tokenizers: a Hugging Face tokenizer.json (tokenizers library), or the built-in byte tokenizer."""

import hashlib
import json
from pathlib import Path
from typing import Protocol

import numpy as np

from configs import UserError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    bos_id: int | None
    identity: str  # "bytes", or "sha256:<hex>" of tokenizer.json

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; 256 is BOS and 257 EOS. Needs no files."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    identity = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Special tokens that mark the end (and start) of a document in common tokenizers.
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


class HFTokenizer:
    """A tokenizer.json from a local folder (e.g. a downloaded Hugging Face model)."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"model.hf_assets_path: no tokenizer.json in '{folder}'")
        # What token shards and checkpoints record of the tokenizer: its file's hash, so that
        # another tokenizer of the same vocabulary size is told apart.
        self.identity = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise UserError(f"model.hf_assets_path: cannot read {path}: {e}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        largest = max(self._tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
        if largest[1] >= self.vocab_size:  # its ids would index past the model's embedding table
            raise UserError(
                f"model.hf_assets_path: {path} gives token {largest[0]!r} id {largest[1]}, beyond its "
                f"vocabulary size {self.vocab_size}"
            )
        named = _special_tokens_from_config(Path(folder) / "tokenizer_config.json")
        self.eos_id = self._find_id(named.get("eos_token"), _EOS_NAMES)
        self.bos_id = self._find_id(named.get("bos_token"), _BOS_NAMES)
        if self.eos_id is None:
            raise UserError(f"model.hf_assets_path: {path} has no end-of-text token to separate documents")

    def _find_id(self, configured: str | None, candidates: tuple[str, ...]) -> int | None:
        for token in (configured, *candidates):
            if token is not None and self._tokenizer.token_to_id(token) is not None:
                return self._tokenizer.token_to_id(token)
        return None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes on all cores (the tokenizers library's thread pool)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def describe(tokenizer: Tokenizer, hf_assets_path: str) -> str:
    """One line for the start-up log."""
    what = f"{hf_assets_path}/tokenizer.json" if hf_assets_path else "the byte tokenizer"
    return f"{what} ({tokenizer.vocab_size:,} tokens, end of document {tokenizer.eos_id})"


def check_token_ids(tokenizer: Tokenizer, tokens: np.ndarray, where: str) -> None:
    """Ids past the vocabulary would index past the embedding table (or wrap in uint16 shards)."""
    if len(tokens) and (tokens.max() >= tokenizer.vocab_size or tokens.min() < 0):
        bad = tokens.max() if tokens.max() >= tokenizer.vocab_size else tokens.min()
        raise UserError(
            f"the tokenizer gave token id {bad} for {where}, outside its vocabulary of "
            f"{tokenizer.vocab_size} (model.hf_assets_path)"
        )


def _special_tokens_from_config(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    found = {}
    for key in ("eos_token", "bos_token"):
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            found[key] = value
    return found


def build_tokenizer(hf_assets_path: str) -> Tokenizer:
    if not hf_assets_path:
        return ByteTokenizer()
    if not Path(hf_assets_path).is_dir():
        raise UserError(f"model.hf_assets_path '{hf_assets_path}' is not a folder")
    return HFTokenizer(hf_assets_path)
