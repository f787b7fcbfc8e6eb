"""The ranks of a test's multi-process run, forked from one process that imported their modules once.

    python tests/fork_ranks.py OUTPUT_FOLDER NPROC SCRIPT [ARGS...]   (environment: conftest.run_ranks)

A rank's start is mostly importing torch and this repository (~3 s of CPU); on the suite's 2 cores
four ranks importing side by side took ~6 s of every 4-rank run. Here the imports happen once
(torch's, and train.py's as a module: its `__main__` block does not run), then each rank is a fork
that sets RANK, LOCAL_RANK and ROLE_RANK, sends its output to OUTPUT_FOLDER/<rank>.out and .err and
runs SCRIPT as `__main__` with ARGS, ending as that script ends (exit code, atexit, Python's
shutdown). Nothing has run before the fork but imports: no thread, no process group, no seed, as in
a fresh process. This process waits; when a rank fails it kills the others, says which failed on
its stderr and exits with that rank's code.
"""

import os
import runpy
import signal
import sys
from pathlib import Path


def run_rank(rank: int, folder: Path, script: str, args: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
    for fd, name in ((1, f"{rank}.out"), (2, f"{rank}.err")):
        os.dup2(os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # (a script that returns without sys.exit)


def main() -> int:
    folder, nproc, script, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` sets it (a copied repository's)
    import torch.distributed.tensor  # noqa: F401  (what every rank imports)

    if Path(script).name == "train.py":
        import train  # noqa: F401  (its modules, from the script's own folder)

    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, folder, script, args)
        ranks[pid] = rank
    first_failure = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not first_failure:
            cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            print(f"rank {rank} failed first ({cause}); the others are stopped", file=sys.stderr)
            first_failure = code if code > 0 else 128 - code
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
