"""The global sample order, each rank's share of it, and the dataloader that batches it.

Optimizer step s reads global samples [c, c + G), where c is the cursor (s x G while the global
batch G is unchanged); data-parallel rank r reads the r-th contiguous slice of G / dp samples, as
its gradient-accumulation micro-batches in order. The state is that one global cursor (plus a
position in the text stream to restart reading from), the same on every rank, so a resumed run on
another number of ranks reads exactly the samples the uninterrupted run would have.
"""

import logging
import warnings

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from configs import UserError
from data.packing import PackedTextStream
from data.shards import TokenShards
from data.sources import build_document_source
from data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# torchdata 0.11 calls an API that torch >= 2.9 deprecates; nothing for users to act on.
warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")


class GlobalOrderDataset(IterableDataset):
    """Yields this rank's samples, step after step, as {"tokens": (L + 1,), "sample_id": k}."""

    def __init__(
        self,
        source: PackedTextStream | TokenShards,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_degree: int,
    ):
        assert global_batch_size % dp_degree == 0, "global batch must divide over data-parallel ranks"
        self.source = source
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        # The state, valid between optimizer steps: next step's first sample, and where to start
        # reading the stream to reach it (a token index at or before it, and its stream position).
        self.cursor = 0
        self.anchor_token = 0
        self.anchor_position = (0, 0, 0)
        self._mid_step = False

    def __iter__(self):
        per_rank = self.global_batch_size // self.dp_degree
        first, last = self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank - 1
        step_start, step_anchor = self.cursor, (self.anchor_token, self.anchor_position)
        for k, position, read in self.source.samples(self.cursor, self.anchor_token, self.anchor_position):
            offset = k - step_start
            if offset == 0:
                step_anchor = (k * self.seq_len, position)
            if first <= offset <= last:
                self._mid_step = offset != last
                if offset == last:  # after this sample the rank is done with the step
                    self.cursor = step_start + self.global_batch_size
                    self.anchor_token, self.anchor_position = step_anchor
                yield {"tokens": torch.from_numpy(read()), "sample_id": k}
            if offset == self.global_batch_size - 1:
                step_start += self.global_batch_size

    def state_dict(self) -> dict:
        if self._mid_step:
            raise RuntimeError("the data state is defined only between optimizer steps")
        return {
            "cursor": self.cursor,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "anchor_token": self.anchor_token,
            "anchor_position": list(self.anchor_position),
        }

    def load_state_dict(self, state: dict) -> None:
        cursor = state["cursor"]
        if state["seq_len"] != self.seq_len:
            # Same place in the token stream, counted in samples of the new length.
            cursor = -(-cursor * state["seq_len"] // self.seq_len)
            logger.warning(
                f"training.seq_len changed from {state['seq_len']} to {self.seq_len}: continuing at the "
                f"same token ({cursor * self.seq_len}), sample {cursor} of the new length"
            )
        if state["global_batch_size"] != self.global_batch_size:
            logger.warning(
                f"training.global_batch_size changed from {state['global_batch_size']} to "
                f"{self.global_batch_size}: the next step reads samples {cursor} to "
                f"{cursor + self.global_batch_size - 1}, continuing the same global order"
            )
        self.cursor = cursor
        self.anchor_token = state["anchor_token"]
        self.anchor_position = tuple(state["anchor_position"])
        self._mid_step = False


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    tokens = torch.stack([s["tokens"] for s in samples])
    return {
        "input": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "sample_ids": torch.tensor([s["sample_id"] for s in samples]),
    }


def build_source(training, tokenizer: Tokenizer) -> PackedTextStream | TokenShards:
    if training.dataset == "tokens":
        shards = TokenShards(training.dataset_path, training.seq_len)
        if shards.vocab_size != tokenizer.vocab_size:
            raise UserError(
                f"the token shards in '{training.dataset_path}' were made with a tokenizer of "
                f"{shards.vocab_size} tokens ({shards.meta['tokenizer']}), but model.hf_assets_path "
                f"gives one of {tokenizer.vocab_size}"
            )
        return shards
    documents = build_document_source(
        training.dataset,
        training.dataset_path,
        training.dataset_text_field,
        training.dataset_subset,
        training.dataset_split,
    )
    return PackedTextStream(documents, tokenizer, training.seq_len)


def plan_batches(training, dp_degree: int) -> tuple[int, int]:
    """(global batch, gradient-accumulation steps): global = local x data-parallel degree x steps."""
    local = training.local_batch_size
    global_batch = local * dp_degree if training.global_batch_size == -1 else training.global_batch_size
    if global_batch % (local * dp_degree):
        raise UserError(
            f"training.global_batch_size ({global_batch}) must be a multiple of local_batch_size x "
            f"data-parallel degree ({local} x {dp_degree})"
        )
    return global_batch, global_batch // (local * dp_degree)


def build_dataloader(
    training,
    tokenizer: Tokenizer,
    global_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    pin_memory: bool = False,
) -> StatefulDataLoader:
    dataset = GlobalOrderDataset(
        build_source(training, tokenizer), training.seq_len, global_batch_size, dp_rank, dp_degree
    )
    # In-process loading: the state must be exact at every step boundary, and packing is cheap next
    # to a training step (pretokenize large corpora with scripts/prepare_data.py).
    return StatefulDataLoader(
        dataset,
        batch_size=training.local_batch_size,
        collate_fn=_collate,
        num_workers=0,
        pin_memory=pin_memory,
    )
