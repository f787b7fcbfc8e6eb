"""The async save in flight: written, checksummed and committed in a background thread, and waited
for at the next save (or at the end) with a bound, never forever.

A writer can stop without a word: its process stopped (SIGSTOP) or stuck in the kernel, a thread
stuck in a write to a hung filesystem. Training, waiting for it at the next save, blocked forever,
silently, deaf to the scheduler's SIGTERM. So the wait
- logs "waiting for the background save of step N (X s so far, given up at Y s)" every
  LOG_EVERY_S seconds, X and Y counted from the moment the save began;
- gives up BASE_S + this rank's share of the checkpoint at checkpoint.async_min_write_mb_per_s
  after the save began (120 s + 18 GB at 50 MB/s = 480 s; healthy writes ran at 1.6-2.5 GB/s on
  the H200 machine), or at once when a stop signal (SIGTERM, SIGUSR1, Ctrl-C) comes while it
  waits. A signal that came before the wait began is the run stopping: it saves after this wait,
  which the bound still ends.
Giving up is the caller's (checkpoint/saving.py): one error line, the previous checkpoint intact.
The thread is a daemon, so that a write stuck for good does not keep the process from exiting (DCP's
own extra writer threads, with writer_threads > 1, are not: one of them stuck still holds the exit).
"""

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)
BASE_S = 120.0  # a writer process's start (10-12 s measured on the H200 machine) and small saves
LOG_EVERY_S = 15.0
POLL_S = 0.25  # how often the wait looks at the stop signals


class BackgroundSave:
    def __init__(self, write: Callable[[], None], step: int, size: int, min_mb_per_s: float):
        """Run write() in a daemon thread now. size: this rank's bytes of the checkpoint, for the
        bound (min_mb_per_s 0: no bound)."""
        self.step, self.began = step, time.monotonic()
        self.limit_s = BASE_S + size / (min_mb_per_s * 1e6) if min_mb_per_s > 0 else math.inf
        self.rule = f"{BASE_S:.0f} s + {size / 1e9:.1f} GB at {min_mb_per_s:g} MB/s"
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(write,), name=f"checkpoint-{step}", daemon=True).start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            self.future.set_result(write())
        except BaseException as e:  # (the waiting thread raises it)
            self.future.set_exception(e)

    def wait(self, stop_requested: Callable[[], str | None]) -> str | None:
        """Wait until the save has ended (raising what stopped it; None), or until it is given up:
        why, in words."""
        signalled_before = stop_requested()
        logged = time.monotonic()
        while not self.future.done():
            try:
                self.future.exception(timeout=POLL_S)
                break
            except TimeoutError:
                pass
            now = time.monotonic()
            if (signal := stop_requested()) and not signalled_before:
                return f"stopped by {signal} while waiting {now - self.began:.0f} s for its background write"
            if now - self.began > self.limit_s:
                return (
                    f"its background write had not finished {now - self.began:.0f} s after it began (the "
                    f"bound: {self.rule}, checkpoint.async_min_write_mb_per_s; a writer stopped or stuck?)"
                )
            if now - logged >= LOG_EVERY_S:
                logged = now
                bound = "" if math.isinf(self.limit_s) else f", given up at {self.limit_s:.0f} s"
                so_far = f"{now - self.began:.0f} s so far{bound}"
                logger.info(f"waiting for the background save of step {self.step} ({so_far})")
        self.future.result()
        return None


def local_bytes(value) -> int:
    """Bytes of the tensors in a state dict that this rank holds (a DTensor's local shard)."""
    if isinstance(value, DTensor):
        return value.to_local().nbytes
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(local_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(local_bytes(item) for item in value)
    return 0
