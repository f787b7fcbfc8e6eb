"""Stopping cleanly on a signal: SIGTERM or SIGUSR1 (a scheduler's notice before it kills the job)
and Ctrl-C (SIGINT) let the current step finish; train.py then saves a checkpoint when
checkpointing is on and exits. A second Ctrl-C exits at once.

The handlers are installed as train() begins, so a signal during start-up (building the model,
loading a checkpoint, which can take minutes) is kept too: the run stops before its first step,
with nothing new to save (a checkpoint it just loaded is already the latest).

A signal may reach the ranks at different moments, so they agree on whether to stop with one tiny
all-reduce on the host, every job.signal_check_interval steps (not every step: at thousands of
ranks a host collective per step costs real time) and once before the first step. A single process
needs no agreement and stops after the step in which the signal came.
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
            logger.warning(
                "Ctrl-C: stopping once this step (or start-up) is done (Ctrl-C again to exit at once)"
            )

    def requested(self, step: int) -> bool:
        """True on every rank at the same step once any rank has received a signal."""
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        if not alone and step % self.check_interval:
            return False
        return self._agree()

    def stopped_during_start_up(self, first_step: int, resumed: bool) -> bool:
        """Before the first step (every rank): whether a signal came during start-up; if one did,
        says that the run stops there, saving nothing (resumed: from the checkpoint of the step
        before first_step)."""
        if not self._agree():
            return False
        why = (
            f"nothing new since the checkpoint of step {first_step - 1} it resumed from"
            if resumed
            else "no step has run"
        )
        logger.info(
            f"stopped by {self.name} during start-up, before step {first_step}: no checkpoint saved ({why})"
        )
        return True

    def _agree(self) -> bool:
        """Whether any rank has received a signal; self.name is then the one that stops the run."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.name = self.received
            return self.received is not None
        # Which signal, as its number; 0 = none. The default group's CPU backend is gloo.
        flag = torch.tensor([signal.Signals[self.received].value if self.received else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.name = signal.Signals(int(flag.item())).name
        return self.name is not None
