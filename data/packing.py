"""Pack a document stream into fixed windows: sample k is tokens [k*L, k*L + L] of the stream.

The stream is every document's tokens followed by EOS, in the source's order, repeated over epochs.
A position in it is (epoch, the document's source position, tokens of that document already
consumed); the source position restarts reading at that document directly (data/sources.py), so
reading can restart at any sample without reading or tokenizing the data before it.

Every data-parallel rank tokenizes the whole text stream, not only its own samples: where sample k
starts depends on the token count of every document before it. That is fine up to tens of ranks;
at scale, tokenize once with scripts/prepare_data.py, whose token shards each rank reads only at
its own samples (data/shards.py). Documents are tokenized in batches, which a Hugging Face
tokenizer spreads over its thread pool.
"""

import logging
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import numpy as np

from configs import UserError
from data.sources import DocumentSource, SourcePosition, corpus_changes
from data.tokenizer import Tokenizer, check_token_ids

logger = logging.getLogger(__name__)

# (epoch, the document's source position (None: the epoch's first document), offset in the
# document's tokens incl. EOS)
Position = tuple[int, SourcePosition | None, int]
START: Position = (0, None, 0)

# Documents tokenized in one call; the character bound keeps a batch of whole books small.
BATCH_DOCUMENTS = 256
BATCH_CHARACTERS = 2**20


class PackedTextStream:
    start = START

    def __init__(
        self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int, extra_tokens: int = 0,
        name: str = "text", allow_change: bool = False,
    ):  # fmt: skip
        """extra_tokens: each sample also holds this many tokens past its labels (multi-token
        prediction's tokens ahead, data/loader.py): sample k is tokens [k*L, k*L + L + extra].
        name: the source's name in metrics (source_samples); allow_change: resume in a corpus whose
        files changed since the checkpoint (training.allow_data_change)."""
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.extra_tokens = extra_tokens
        self.name = name
        self.allow_change = allow_change
        self._warned_small = False
        self._announced: set[int] = set()  # epochs whose start was logged

    def summary(self) -> str:
        """One line for the start-up log."""
        files = getattr(self.source, "files", None)
        if files is not None:
            size = sum(f.stat().st_size for f in files)
            where = f"{len(files):,} file{'s' * (len(files) != 1)}, {size / 2**20:,.1f} MiB"
            return f"text '{self.name}' ({where}), tokenized while training, in order"
        return f"text '{self.name}', streamed and tokenized while training, in order"

    def data_state(self) -> dict:
        """The kind, and what identifies the corpus (its files and sizes; a stream's name)."""
        return {"kind": "text", **(self.source.describe() if hasattr(self.source, "describe") else {})}

    def counts(self, anchor: Position, cursor: int) -> dict[str, dict[str, int]]:
        """Samples read (the cursor) and the epoch (at the step's start), for metrics.jsonl."""
        return {"source_samples": {self.name: cursor}, "source_epochs": {self.name: anchor[0] + 1}}

    def _tokenized_documents(self, epoch: int, start: SourcePosition | None) -> Iterator:
        """(epoch, source position, tokens + EOS) for each document from `start` on, epoch after epoch."""
        while True:
            for position, tokens in tokenize(self.source, self.tokenizer, start):
                yield epoch, position, tokens
            epoch, start = epoch + 1, None

    def samples(
        self, first_sample: int, anchor_token: int, anchor: Position
    ) -> Iterator[tuple[int, Position, Callable[[], np.ndarray]]]:
        """Yield (k, position of token k*L, a function returning sample k's tokens), k >= first_sample.

        Reading starts at stream position `anchor`, which is global token index `anchor_token`
        (at or before the first sample's first token).
        """
        length, window_length = self.seq_len, self.seq_len + 1 + self.extra_tokens
        k = first_sample
        buffer = np.empty(0, dtype=np.int64)
        buffer_start = anchor_token  # global token index of buffer[0]
        # Pieces of documents in the buffer: (global token index where it starts, its position).
        pieces: list[tuple[int, Position]] = []
        skip = anchor[2]  # the anchor may sit inside its document
        # No sample before a document with text: a corpus of empty documents is refused at the end
        # of its first epoch (tokenize), before any sample of EOS alone is read.
        text_seen = False
        for epoch, document, tokens in self._tokenized_documents(anchor[0], anchor[1]):
            if epoch > anchor[0] and epoch not in self._announced:  # once per epoch and stream
                self._announced.add(epoch)
                at = buffer_start + len(buffer)
                logger.info(f"data source '{self.name}' starts epoch {epoch + 1} (at token {at:,})")
            if epoch > anchor[0] and k == 0 and not self._warned_small:  # a whole epoch, no sample yet
                self._warned_small = True
                logger.warning(
                    f"the dataset holds fewer tokens than one sample (seq_len + 1 = {window_length}): "
                    "each sample repeats its documents; give more data or a smaller training.seq_len"
                )
            pieces.append((buffer_start + len(buffer), (epoch, document, skip)))
            buffer = np.concatenate((buffer, tokens[skip:]))
            skip = 0
            text_seen = text_seen or len(tokens) > 1
            while text_seen and buffer_start + len(buffer) >= k * length + window_length:
                start = k * length - buffer_start
                window = buffer[start : start + window_length]
                yield k, _position_of(pieces, k * length), partial(np.copy, window)
                k += 1
            # Drop what no later sample needs (also skips ahead to the first sample).
            drop = min(k * length - buffer_start, len(buffer))
            buffer, buffer_start = buffer[drop:], buffer_start + drop
            while len(pieces) > 1 and pieces[1][0] <= buffer_start:
                pieces.pop(0)

    def restart_point(
        self, anchor_token: int, saved: list | None, saved_data: dict | None = None, cursor: int = 0
    ) -> tuple[int, Position]:  # fmt: skip
        """(anchor token, position) to restart from, given what a data state saved.

        Checkpoints written before positions were source-specific hold [epoch, document index,
        offset]: they still load, by counting documents from the start once (with a warning).
        A state saved while reading token shards holds no stream position: reading starts at the
        stream's start and skips to the cursor.
        """
        if saved is None or (saved_data is not None and saved_data.get("kind") != "text"):
            logger.warning(
                "the data state was saved reading token shards: reading the text stream from its start "
                f"up to token {anchor_token} to continue"
            )
            return 0, START
        epoch, document, offset = saved
        if saved_data is not None and "files" in saved_data | self.data_state():  # (not hf: a stream)
            changed = corpus_changes(saved_data, self.data_state())
            if changed and not self.allow_change:
                raise UserError(
                    f"the text data changed since the checkpoint ({changed}): its position would point "
                    "elsewhere in the corpus; to continue anyway set training.allow_data_change (reading "
                    "then goes on at the same file if it is still there, else at the next one in order)"
                )
            if changed:
                document, offset = self.source.reposition(document, offset, saved_data)
                where = self.source.where(document) if document else "the start of the epoch"
                logger.warning(
                    f"the text data changed since the checkpoint ({changed}); continuing at {where}"
                )
        if document == 0:  # an older format's first document: nothing to count
            return anchor_token, (epoch, None, offset)
        if isinstance(document, int):
            logger.warning(
                f"the checkpoint holds its data position as a document index ({document}), an older "
                "format: counting documents up to it once; checkpoints written from now on restart directly"
            )
            return anchor_token, (epoch, self._position_of_document(document), offset)
        return anchor_token, (epoch, document, offset)

    def _position_of_document(self, index: int) -> SourcePosition:
        for count, (position, _) in enumerate(self.source.documents(None)):
            if count == index:
                return position
        raise UserError(
            f"the checkpoint's data position (document {index}) is past the end of the dataset: "
            "was training.dataset_path changed?"
        )


def tokenize(
    source: DocumentSource, tokenizer: Tokenizer, start: SourcePosition | None = None
) -> Iterator[tuple[SourcePosition, np.ndarray]]:
    """One epoch of (position, tokens + EOS) from the document at `start` on, encoded in batches;
    a document read in pieces (data/sources.py: long .txt files) gives its pieces' tokens, EOS
    after the last.

    Refuses token ids outside the vocabulary, and an epoch read from its start that holds no text
    (no documents, or only empty ones, which would train on EOS alone).
    """
    documents = with_text = 0
    ends_document = getattr(source, "ends_document", lambda position: True)
    for batch in _batches(source.documents(start)):
        positions, texts = zip(*batch)
        for position, ids in zip(positions, tokenizer.encode_batch(list(texts))):
            ends = ends_document(position)
            tokens = np.asarray(ids + [tokenizer.eos_id] if ends else ids, dtype=np.int64)
            check_token_ids(tokenizer, tokens, source.where(position))
            documents += ends
            with_text += len(ids) > 0
            yield position, tokens
    if start is None and not with_text:
        what = "no documents" if documents == 0 else f"only empty documents, {documents} of them"
        raise UserError(f"the dataset has {what} (training.dataset / dataset_path)")


def _batches(documents: Iterable[tuple[SourcePosition, str]]) -> Iterator[list[tuple[SourcePosition, str]]]:
    batch, characters = [], 0
    for document in documents:
        batch.append(document)
        characters += len(document[1])
        if len(batch) == BATCH_DOCUMENTS or characters >= BATCH_CHARACTERS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch


def _position_of(pieces: list[tuple[int, Position]], token: int) -> Position:
    for start, (epoch, document, offset) in reversed(pieces):
        if start <= token:
            return epoch, document, offset + token - start
    raise AssertionError("token before the buffered pieces")
