"""Preemption: on SIGTERM or SIGUSR1 finish the current step, save a checkpoint and exit cleanly.

Schedulers send these before killing a job (Slurm: `--signal=USR1@120`; torchrun forwards SIGTERM).
A signal may reach ranks at different moments, so at each step end the ranks agree with one tiny
all-reduce on a CPU tensor (no device synchronization).
"""

import signal

import torch
import torch.distributed as dist


class PreemptionWatcher:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        """True on every rank once any rank has received a signal."""
        flag = torch.tensor([1 if self.signal_name else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the default group's CPU backend is gloo
        return bool(flag.item())
