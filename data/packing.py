"""Pack a document stream into fixed windows: sample k is tokens [k*L, k*L + L] of the stream.

The stream is every document's tokens followed by EOS, in the source's order, repeated over epochs.
A position in it is (epoch, document index, tokens of that document already consumed), so reading
can restart at any sample without replaying the data before it.
"""

from collections.abc import Callable, Iterator
from functools import partial

import numpy as np

from configs import UserError
from data.sources import DocumentSource
from data.tokenizer import Tokenizer

Position = tuple[int, int, int]  # (epoch, document, offset in the document's tokens incl. EOS)


class PackedTextStream:
    def __init__(self, documents: DocumentSource, tokenizer: Tokenizer, seq_len: int):
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len

    def _tokenized_documents(self, epoch: int, start: int) -> Iterator[tuple[int, int, np.ndarray]]:
        while True:
            count = 0
            for index, text in enumerate(self.documents(start), start):
                count += 1
                tokens = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
                yield epoch, index, np.asarray(tokens, dtype=np.int64)
            if count == 0 and start == 0:
                raise UserError("the dataset has no documents (training.dataset / dataset_path)")
            epoch, start = epoch + 1, 0

    def samples(
        self, first_sample: int, anchor_token: int, anchor: Position
    ) -> Iterator[tuple[int, Position, Callable[[], np.ndarray]]]:
        """Yield (k, position of token k*L, a function returning sample k's tokens), k >= first_sample.

        Reading starts at stream position `anchor`, which is global token index `anchor_token`
        (at or before the first sample's first token).
        """
        length = self.seq_len
        k = first_sample
        buffer = np.empty(0, dtype=np.int64)
        buffer_start = anchor_token  # global token index of buffer[0]
        # Pieces of documents in the buffer: (global token index where it starts, its position).
        pieces: list[tuple[int, Position]] = []
        skip = anchor[2]  # the anchor may sit inside its document
        for epoch, document, tokens in self._tokenized_documents(anchor[0], anchor[1]):
            pieces.append((buffer_start + len(buffer), (epoch, document, skip)))
            buffer = np.concatenate((buffer, tokens[skip:]))
            skip = 0
            while buffer_start + len(buffer) >= k * length + length + 1:
                start = k * length - buffer_start
                window = buffer[start : start + length + 1]
                yield k, _position_of(pieces, k * length), partial(np.copy, window)
                k += 1
            # Drop what no later sample needs (also skips ahead to the first sample).
            drop = min(k * length - buffer_start, len(buffer))
            buffer, buffer_start = buffer[drop:], buffer_start + drop
            while len(pieces) > 1 and pieces[1][0] <= buffer_start:
                pieces.pop(0)


def _position_of(pieces: list[tuple[int, Position]], token: int) -> Position:
    for start, (epoch, document, offset) in reversed(pieces):
        if start <= token:
            return epoch, document, offset + token - start
    raise AssertionError("token before the buffered pieces")
