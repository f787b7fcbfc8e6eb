"""Stopping cleanly on a signal: SIGTERM or SIGUSR1 (a scheduler's notice before it kills the job)
and Ctrl-C (SIGINT) let the current step finish; train.py then saves a checkpoint when
checkpointing is on and exits. A second Ctrl-C exits at once.

A signal may reach the ranks at different moments, so they agree on whether to stop with one tiny
all-reduce on the host, every job.signal_check_interval steps (not every step: at thousands of
ranks a host collective per step costs real time). A single process needs no agreement and stops
after the step in which the signal came.
"""

import logging
import signal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class StopSignals:
    def __init__(self, check_interval: int):
        self.check_interval = check_interval
        self.received: str | None = None  # the first signal this process got
        self.name: str | None = None  # the signal that stops the run (maybe another rank's)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.received = self.received or signal.Signals(signum).name
        if signum == signal.SIGINT:
            # The next Ctrl-C takes the default action: the process ends at once.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            logger.warning("Ctrl-C: stopping after this step (Ctrl-C again to exit at once)")

    def requested(self, step: int) -> bool:
        """True on every rank at the same step once any rank has received a signal."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.name = self.received
            return self.received is not None
        if step % self.check_interval:
            return False
        # Which signal, as its number; 0 = none. The default group's CPU backend is gloo.
        flag = torch.tensor([signal.Signals[self.received].value if self.received else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.name = signal.Signals(int(flag.item())).name
        return self.name is not None
