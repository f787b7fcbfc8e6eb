"""The global sample order, each rank's share of it, and the loader that batches it by step.

Optimizer step s reads global samples [c, c + G), where c is the cursor (s x G while the global
batch G is unchanged); data-parallel rank r reads the r-th contiguous slice of G / dp samples, as
its gradient-accumulation micro-batches in order. The state is that one global cursor, the same on
every rank, plus a position to restart reading from (a place in the text stream, data/packing.py;
or each source's sample count in a mixture of token shards, data/mixture.py) and what the order
depends on, so a resumed run on another number of ranks reads exactly the samples the
uninterrupted run would have.

The next steps' micro-batches are read ahead by a thread (torchdata's Prefetcher, pinned on CUDA),
each carrying the data state after it: what a step reads and what a checkpoint records do not
depend on reading ahead.

Text sources are tokenized by every rank (the packing needs every document's token count); at
scale, token shards from scripts/prepare_data.py let each rank read only its own samples.
"""

import json
import logging
import time
from collections.abc import Iterator

import torch

from configs import UserError
from data.mixture import ShardMixture, parse_weights
from data.packing import PackedTextStream
from data.prefetch import StepPrefetcher, pin
from data.shards import check_tokenizer
from data.sources import build_document_source
from data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
TEXT_RANKS = 4  # more data-parallel ranks than this on raw text are warned about


class GlobalSampleOrder:
    """Yields this rank's samples, step after step, as {"tokens": (L + 1,), "sample_id": k}."""

    def __init__(
        self,
        source: PackedTextStream | ShardMixture,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        tokenizer_id: str = "",
        allow_tokenizer_change: bool = False,
    ):
        """tokenizer_id: the run's tokenizer (data/tokenizer.py identity), recorded in the state; a
        state recorded with another is refused unless allow_tokenizer_change."""
        assert global_batch_size % dp_degree == 0, "global batch must divide over data-parallel ranks"
        self.source = source
        self.tokenizer_id, self.allow_tokenizer_change = tokenizer_id, allow_tokenizer_change
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        # The state, valid between optimizer steps: next step's first sample, and where to start
        # reading to reach it (a token index at or before it, and the source's position there).
        self.cursor = 0
        self.anchor_token = 0
        self.anchor_position = source.start
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
            "data": json.dumps(self.source.data_state()),  # what the order depends on
            "tokenizer": self.tokenizer_id,
        }

    def load_state_dict(self, state: dict) -> None:
        saved_tokenizer = state.get("tokenizer")  # (not in states written before it was recorded)
        if saved_tokenizer and self.tokenizer_id and saved_tokenizer != self.tokenizer_id:
            if not self.allow_tokenizer_change:
                raise UserError(
                    f"the checkpoint was trained with another tokenizer ({saved_tokenizer[:19]}...) than "
                    f"this run's ({self.tokenizer_id[:19]}..., model.hf_assets_path): its token ids would "
                    "mean other tokens; set training.allow_tokenizer_change to continue anyway"
                )
            logger.warning(
                "continuing with another tokenizer than the checkpoint's (training.allow_tokenizer_change)"
            )
        cursor = state["cursor"]
        by_sample = getattr(self.source, "restarts_by_sample", False)
        if state["seq_len"] != self.seq_len and by_sample:
            logger.warning(
                f"training.seq_len changed from {state['seq_len']} to {self.seq_len}: each source "
                f"continues at the same sample count, in samples of the new length"
            )
        elif state["seq_len"] != self.seq_len:
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
        saved_data = json.loads(state["data"]) if state.get("data") else None  # older states: none
        self.cursor = cursor
        self.anchor_token, self.anchor_position = self.source.restart_point(
            state["anchor_token"], state["anchor_position"], saved_data, cursor
        )
        self._mid_step = False

    def counts(self) -> dict[str, dict[str, int]]:
        """source_samples and source_epochs at the cursor (metrics.jsonl)."""
        return self.source.counts(self.anchor_position, self.cursor)


class StepLoader:
    """This rank's micro-batches, one optimizer step at a time, and the data state to checkpoint.

    With prefetch_steps > 0 a thread reads that many steps ahead (data/prefetch.py); every step
    carries the data state after it, and state_dict() is the state after the last step handed out.
    """

    def __init__(
        self, order: GlobalSampleOrder, local_batch_size: int, pin_memory: bool = False,
        prefetch_steps: int = 0,
    ):  # fmt: skip
        per_rank = order.global_batch_size // order.dp_degree
        assert per_rank % local_batch_size == 0, "a rank's share of a step must be whole micro-batches"
        self.order = order
        self.local_batch_size = local_batch_size
        self.accumulation_steps = per_rank // local_batch_size
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.prefetch_steps = prefetch_steps
        self._steps = None  # the steps from the state on (an iterator, or a StepPrefetcher)
        self._state = order.state_dict()  # after the last step handed out
        self._waited, self._steps_handed = 0.0, 0  # since the last accounting()

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The next optimizer step's `accumulation_steps` micro-batches of this rank, each
        {"input", "labels": (local_batch_size, seq_len), "sample_ids": (local_batch_size,)}; with
        multi-token prediction of depth D the labels are (local_batch_size, 1 + D, seq_len), row d
        the tokens d + 1 positions ahead of the input."""
        if self._steps is None:
            steps = self._read_steps()
            self._steps = (
                StepPrefetcher(steps, self.prefetch_steps, self.pin_memory) if self.prefetch_steps else steps
            )
        start = time.perf_counter()
        step = next(self._steps)
        self._waited += time.perf_counter() - start
        self._steps_handed += 1
        self._state = step["state"]
        return step["batches"]

    def _read_steps(self) -> Iterator[dict]:
        samples = iter(self.order)
        while True:
            batches = [self._micro_batch(samples) for _ in range(self.accumulation_steps)]
            if self.pin_memory and not self.prefetch_steps:
                batches = [pin(batch) for batch in batches]  # (reading ahead pins in its own thread)
            yield {"batches": batches, "state": self.order.state_dict()}

    def _micro_batch(self, samples: Iterator[dict]) -> dict[str, torch.Tensor]:
        samples = [next(samples) for _ in range(self.local_batch_size)]
        tokens = torch.stack([s["tokens"] for s in samples])
        length, ahead = self.order.seq_len, tokens.shape[1] - 1 - self.order.seq_len
        labels = tokens[:, 1 : length + 1]
        if ahead:  # multi-token prediction: depth d's labels are d tokens further on
            labels = torch.stack([tokens[:, 1 + depth : 1 + depth + length] for depth in range(1 + ahead)], 1)
        return {
            "input": tokens[:, :length],
            "labels": labels,
            "sample_ids": torch.tensor([s["sample_id"] for s in samples]),
        }

    def summary(self) -> str:
        return self.order.source.summary()

    def accounting(self) -> dict:
        """For metrics.jsonl: source_samples and source_epochs after the last step handed out, and
        data_wait_ms, the mean time a step waited for its batches since the last call."""
        counts = self.order.source.counts(self._state["anchor_position"], self._state["cursor"])
        waited = 1000 * self._waited / max(self._steps_handed, 1)
        self._waited, self._steps_handed = 0.0, 0
        return {**counts, "data_wait_ms": round(waited, 3)}

    def state_dict(self) -> dict:
        return {**self._state, "local_batch_size": self.local_batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.order.load_state_dict(state)
        self._state = self.order.state_dict()
        # The order warns of a new global batch; a new micro-batch size alone changes only rounding.
        saved_local = state.get("local_batch_size", self.local_batch_size)  # (older states: none)
        same_global = state["global_batch_size"] == self.order.global_batch_size
        if saved_local != self.local_batch_size and same_global:
            logger.info(
                f"training.local_batch_size changed from {saved_local} to {self.local_batch_size}, the "
                f"global batch stays {self.order.global_batch_size}: each rank reads "
                f"{self.accumulation_steps} micro-batches a step, the same samples in the same order "
                "(losses equal up to rounding)"
            )

    def close(self) -> None:
        """Stops reading ahead (the next step reopens reading at the state)."""
        if isinstance(self._steps, StepPrefetcher):
            self._steps.close()
        self._steps = None


def build_source(
    training, tokenizer: Tokenizer, extra_tokens: int = 0, seed: int = 0
) -> PackedTextStream | ShardMixture:
    """seed: the shuffling's key (job.seed)."""
    if training.dataset == "tokens":
        folders = [folder.strip() for folder in training.dataset_path.split(",") if folder.strip()]
        weights = parse_weights(training.dataset_weights, len(folders))
        mixture = ShardMixture(
            folders,
            weights,
            training.seq_len,
            extra_tokens,
            training.shuffle,
            seed,
            training.allow_data_change,
        )
        check_tokenizer(dict(zip(mixture.names, mixture.sources)), tokenizer, training.allow_tokenizer_change)
        return mixture
    if training.dataset_weights.strip():
        raise UserError(
            "training.dataset_weights mixes token-shard folders (training.dataset = 'tokens'); "
            f"training.dataset '{training.dataset}' is one source: prepare the sources with "
            "scripts/prepare_data.py to mix them"
        )
    documents = build_document_source(
        training.dataset,
        training.dataset_path,
        training.dataset_text_field,
        training.dataset_subset,
        training.dataset_split,
    )
    name = training.dataset if training.dataset == "python_docs" else training.dataset_path
    allow_change = training.allow_data_change
    return PackedTextStream(documents, tokenizer, training.seq_len, extra_tokens, name, allow_change)


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
    seed: int = 0,
    prefetch_steps: int = 0,
) -> StepLoader:
    """extra_tokens: tokens past each sample's labels (the model's multi-token-prediction depth);
    seed: the shuffling's key; prefetch_steps: steps read ahead by a thread (0: none)."""
    source = build_source(training, tokenizer, extra_tokens, seed)
    if isinstance(source, PackedTextStream) and dp_degree > TEXT_RANKS:
        logger.warning(
            f"every one of the {dp_degree} data-parallel ranks tokenizes all of the text: "
            f"{global_batch_size * training.seq_len:,} tokens per step each, whatever the number of ranks "
            "(about 0.3 M tokens/s per core for a 32k BPE, docs/data.md); prepare token shards once with "
            "scripts/prepare_data.py --workers N and train on them (training.dataset = 'tokens')"
        )
    order = GlobalSampleOrder(
        source, training.seq_len, global_batch_size, dp_rank, dp_degree, tokenizer.identity,
        training.allow_tokenizer_change,
    )  # fmt: skip
    return StepLoader(order, training.local_batch_size, pin_memory, prefetch_steps)
