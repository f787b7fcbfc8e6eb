"""Reading ahead: the next steps' micro-batches are prepared by a thread while the current step runs.

torchdata's nodes do it (the design card names torchdata): Prefetcher keeps `depth` steps queued,
PinMemory (on CUDA) pins their tensors in page-locked memory in a thread of its own, for the
non-blocking copies to the GPU. The steps come from one generator in order, so reading ahead changes
neither which samples a step reads nor the data state each step carries. (torchdata's weighted
sampler draws sources at random; the mixture's order is data/mixture.py's own.)

An error raised while reading (a damaged shard, a bad line of text) is handed over as an item and
raised in the training thread as it was raised: the same one-line error as without reading ahead.
"""

import atexit
from collections.abc import Iterator

import torch
from torchdata.nodes import IterableWrapper, PinMemory, Prefetcher


def _errors_as_items(steps: Iterator[dict]) -> Iterator[dict]:
    try:
        yield from steps
    except Exception as error:  # raised again by the reader (StepPrefetcher.__next__)
        yield {"error": error}


class StepPrefetcher:
    """Iterates steps (dicts) `depth` items ahead of the caller; pins tensors when pin is true."""

    def __init__(self, steps: Iterator[dict], depth: int, pin: bool):
        node = IterableWrapper(_errors_as_items(steps))
        self._nodes = [node]
        if pin:
            node = PinMemory(node, "cuda")  # the calling thread's current device
            self._nodes.append(node)
        node = Prefetcher(node, prefetch_factor=depth)
        self._nodes.append(node)
        self._root = node
        self._root.reset()
        # The threads must be stopped before the interpreter exits: one still inside torch at
        # exit aborts the process (seen with two ranks on CPU).
        atexit.register(self.close)

    def __next__(self) -> dict:
        item = next(self._root)
        if "error" in item:
            raise item["error"]
        return item

    def close(self) -> None:
        for node in reversed(self._nodes):
            worker = getattr(node, "_it", None)  # torchdata's thread of this node
            if worker is not None and hasattr(worker, "_shutdown"):
                worker._shutdown()
        self._nodes = []
        atexit.unregister(self.close)


def pin(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Page-locked host memory: copies to the GPU run asynchronously."""
    return {name: tensor.pin_memory() for name, tensor in batch.items()}
