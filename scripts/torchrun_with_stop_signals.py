"""torchrun, except that SIGTERM, SIGUSR1 and Ctrl-C let the workers save and stop, with no traceback.

    python scripts/torchrun_with_stop_signals.py [torchrun options] train.py --config X.toml ...

The README's multi-process commands, scripts/multinode.sh and scripts/slurm.sbatch launch through
it. What torchrun itself does (torch 2.13, torch/distributed/elastic; the same since
--signals-to-handle came in 2.9): a signal in --signals-to-handle (default SIGTERM, SIGINT, SIGHUP,
SIGQUIT) is forwarded to every worker, which saves a checkpoint and exits 0, but torchrun then
raises SignalException, prints its 25-line traceback and exits 1 whatever the workers did, and kills
a worker still saving after --shutdown-timeout (30 s). SIGUSR1, Slurm's notice before the time
limit, is not in that list: it kills torchrun, and the workers, each in a session of its own, train
on.

Here torchrun runs in this process with SIGTERM, SIGUSR1 and SIGINT taken out of its list; this
process hands them to the workers and keeps waiting, so the workers finish their step, save, exit
0, and torchrun returns as after any finished run. SIGTERM and SIGUSR1 reach the workers as they
came (exit 0); Ctrl-C reaches them as SIGTERM, so that they too exit 0 (a worker stopped by SIGINT
exits 130, which torchrun would report as a failure), and this process then exits 130, as a program
stopped by Ctrl-C does. The workers run in sessions of their own: a terminal's Ctrl-C reaches only
this process, and the workers get one signal each, from here. A second Ctrl-C ends the workers at
once (SIGKILL; the checkpoint being written is never complete, so never loaded) and exits 130.
SIGHUP and SIGQUIT stay torchrun's.
"""

import os
import signal
import sys
from pathlib import Path

from torch.distributed.run import main as torchrun

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_HANDLES = "SIGHUP,SIGQUIT"
INTERRUPTED = 128 + signal.SIGINT  # the exit code of a program stopped by Ctrl-C
interrupted = False  # by Ctrl-C: exit INTERRUPTED once the workers have stopped


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


def signal_workers(signum: int) -> bool:
    """Send signum to every worker; False if none has started yet."""
    workers = worker_pids()
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # it has just ended
    return bool(workers)


def hand_to_workers(signum: int, frame) -> None:
    if not signal_workers(signum):  # none started yet (rendezvous): stop, as torchrun would
        raise SystemExit(128 + signum)


def interrupt(signum: int, frame) -> None:
    """The first Ctrl-C: the workers save and stop (SIGTERM); the next ends everything at once."""
    global interrupted
    interrupted = True
    signal.signal(signal.SIGINT, kill_everything)
    if not signal_workers(signal.SIGTERM):
        raise SystemExit(INTERRUPTED)
    print("Ctrl-C: the workers stop after their step, saving a checkpoint if enabled (Ctrl-C again "
          "to end them at once)", file=sys.stderr, flush=True)  # fmt: skip


def kill_everything(signum: int, frame) -> None:
    signal_workers(signal.SIGKILL)
    os._exit(INTERRUPTED)  # not SystemExit: torchrun's clean-up would wait for the workers


if __name__ == "__main__":
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, hand_to_workers)
    signal.signal(signal.SIGINT, interrupt)
    # First, so that a --signals-to-handle given on the command line still wins.
    sys.argv[1:1] = ["--signals-to-handle", TORCHRUN_HANDLES]
    code = torchrun()
    sys.exit(INTERRUPTED if interrupted else code)
