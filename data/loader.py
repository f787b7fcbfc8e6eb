"""The global sample order, each rank's share of it, and the loader that batches it by step.

Optimizer step s reads global samples [c, c + G), where c is the cursor (s x G while the global
batch G is unchanged); data-parallel rank r reads the r-th contiguous slice of G / dp samples, as
its gradient-accumulation micro-batches in order. The state is that one global cursor (plus a
position in the text stream to restart reading from, data/packing.py), the same on every rank, so
a resumed run on another number of ranks reads exactly the samples the uninterrupted run would have.

Text sources are tokenized by every rank (the packing needs every document's token count); at
scale, token shards from scripts/prepare_data.py let each rank read only its own samples.
"""

import logging

import torch

from configs import UserError
from data.packing import START, PackedTextStream
from data.shards import TokenShards
from data.sources import build_document_source
from data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GlobalSampleOrder:
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
        # reading the stream to reach it (a token index at or before it, and its stream position;
        # None for token shards, which need none).
        self.cursor = 0
        self.anchor_token = 0
        self.anchor_position = START
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
            "anchor_position": None if self.anchor_position is None else list(self.anchor_position),
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
        self.anchor_token, self.anchor_position = self.source.restart_point(
            state["anchor_token"], state["anchor_position"]
        )
        self._mid_step = False


class StepLoader:
    """This rank's micro-batches, one optimizer step at a time, and the data state to checkpoint.

    Loading runs in the training process: the state is the global cursor, exact at every step
    boundary, and packing costs little next to a training step.
    """

    def __init__(self, order: GlobalSampleOrder, local_batch_size: int, pin_memory: bool = False):
        per_rank = order.global_batch_size // order.dp_degree
        assert per_rank % local_batch_size == 0, "a rank's share of a step must be whole micro-batches"
        self.order = order
        self.local_batch_size = local_batch_size
        self.accumulation_steps = per_rank // local_batch_size
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._samples = None  # this rank's samples from the state on; opened at the first step

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The next optimizer step's `accumulation_steps` micro-batches of this rank, each
        {"input", "labels": (local_batch_size, seq_len), "sample_ids": (local_batch_size,)}; with
        multi-token prediction of depth D the labels are (local_batch_size, 1 + D, seq_len), row d
        the tokens d + 1 positions ahead of the input."""
        if self._samples is None:
            self._samples = iter(self.order)
        return [self._micro_batch() for _ in range(self.accumulation_steps)]

    def _micro_batch(self) -> dict[str, torch.Tensor]:
        samples = [next(self._samples) for _ in range(self.local_batch_size)]
        tokens = torch.stack([s["tokens"] for s in samples])
        length, ahead = self.order.seq_len, tokens.shape[1] - 1 - self.order.seq_len
        labels = tokens[:, 1 : length + 1]
        if ahead:  # multi-token prediction: depth d's labels are d tokens further on
            labels = torch.stack([tokens[:, 1 + depth : 1 + depth + length] for depth in range(1 + ahead)], 1)
        batch = {
            "input": tokens[:, :length],
            "labels": labels,
            "sample_ids": torch.tensor([s["sample_id"] for s in samples]),
        }
        if self.pin_memory:  # page-locked host memory copies to the GPU asynchronously
            batch = {name: tensor.pin_memory() for name, tensor in batch.items()}
        return batch

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
        self._samples = None  # reopened at the loaded cursor


def build_source(training, tokenizer: Tokenizer, extra_tokens: int = 0) -> PackedTextStream | TokenShards:
    if training.dataset == "tokens":
        shards = TokenShards(training.dataset_path, training.seq_len, extra_tokens)
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
    return PackedTextStream(documents, tokenizer, training.seq_len, extra_tokens)


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
    extra_tokens: int = 0,
) -> StepLoader:
    """extra_tokens: tokens past each sample's labels (the model's multi-token-prediction depth)."""
    source = build_source(training, tokenizer, extra_tokens)
    order = GlobalSampleOrder(source, training.seq_len, global_batch_size, dp_rank, dp_degree)
    return StepLoader(order, training.local_batch_size, pin_memory)
