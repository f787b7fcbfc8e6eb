"""torchrun, except that SIGTERM and SIGUSR1 go to the workers and the exit code is theirs.

    python scripts/torchrun_with_stop_signals.py [torchrun options] train.py --config X.toml ...

scripts/multinode.sh and scripts/slurm.sbatch launch through it. What torchrun itself does (torch
2.13, torch/distributed/elastic; the same since --signals-to-handle came in 2.9): a signal in
--signals-to-handle (default SIGTERM, SIGINT, SIGHUP, SIGQUIT) is forwarded to every worker, which
saves a checkpoint and exits 0, but torchrun then raises SignalException and exits 1 whatever the
workers did, and kills a worker still saving after --shutdown-timeout (30 s). SIGUSR1, Slurm's
notice before the time limit, is not in that list: it kills torchrun, and the workers, each in a
session of its own, train on.

Here torchrun runs in this process with SIGTERM and SIGUSR1 taken out of its list; this process
hands either to the workers and keeps waiting, so the workers finish their step, save, exit 0, and
torchrun returns 0 as after any finished run. SIGINT, SIGHUP and SIGQUIT stay torchrun's.
"""

import os
import signal
import sys
from pathlib import Path

from torch.distributed.run import main as torchrun

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_HANDLES = "SIGINT,SIGHUP,SIGQUIT"


def worker_pids() -> list[int]:
    """This process's children: the workers torchrun started."""
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it just ended
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():  # the parent, after the command name
            workers.append(int(entry.name))
    return workers


def hand_to_workers(signum: int, frame) -> None:
    workers = worker_pids()
    if not workers:  # none started yet (rendezvous): stop, as torchrun would
        raise SystemExit(128 + signum)
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # it has just ended


if __name__ == "__main__":
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, hand_to_workers)
    # First, so that a --signals-to-handle given on the command line still wins.
    sys.argv[1:1] = ["--signals-to-handle", TORCHRUN_HANDLES]
    sys.exit(torchrun())
