"""The actor in each process of a Monarch mesh: it starts one rank of train.py as a child process
and answers the controller's polls.

Not Monarch's SPMDActor, which sets the same torchrun variables but runs the script inside the
actor's process (runpy): train.py's stop signals need a main thread of its own, and a child process
can be signalled, killed and waited for. The child runs in a session of its own (a terminal's
Ctrl-C reaches the controller only, which forwards it once), with its output on the actor's
(the controller's terminal on a local mesh; the worker's log under a scheduler), and it dies with
the actor's process (die_with_parent.py): nothing outlives a torn-down mesh or a killed controller.
"""

import contextlib
import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from monarch.actor import Actor, current_rank, current_size, endpoint

from scripts.monarch_launcher.progress import last_logged_step

DIE_WITH_PARENT = str(Path(__file__).with_name("die_with_parent.py"))


@dataclasses.dataclass
class RankReport:
    """One rank's state when polled."""

    rank: int
    host: str
    pid: int | None  # train.py's; None if it could not be started
    exit_code: int | None  # None while running; negative: killed by that signal (as Popen says)
    ended_at: float | None  # time.time() when it ended: the first rank to end names the cause
    last_step: int | None  # rank 0 only: the last step in metrics.jsonl
    progress: int  # rank 0 only: how often last_step rose since train.py started
    start_error: str | None = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerActor(Actor):
    """One rank: its place in the mesh gives RANK, LOCAL_RANK, GROUP_RANK and the sizes, as torchrun
    would set them (the mesh's last dimension is the processes of one host)."""

    def __init__(self) -> None:
        point, sizes = current_rank(), current_size()
        per_host = point.extent.labels[-1]
        self.rank = point.rank
        self.local_rank = point[per_host]
        self.local_world_size = sizes[per_host]
        self.world_size = math.prod(sizes.values())
        self.group_rank = self.rank // self.local_world_size
        self.process: subprocess.Popen | None = None
        self.start_error: str | None = None
        self.ended_at: float | None = None
        self.metrics_file: Path | None = None
        self.last_step: int | None = None
        self.progress = 0

    @endpoint
    def rendezvous_address(self, local: bool) -> tuple[str, int]:
        """MASTER_ADDR and a free MASTER_PORT on this host (asked of rank 0, once per attempt)."""
        return ("127.0.0.1" if local else socket.gethostname()), free_port()

    @endpoint
    def start(self, argv: list[str], cwd: str, env: dict[str, str], host_env: list[dict[str, str]],
              metrics_file: str, log_file: str | None) -> None:  # fmt: skip
        """Start train.py: argv after the interpreter, env shared by every rank, host_env[host] this
        host's own (a local mesh's GPU split), metrics_file where rank 0 logs its steps, log_file
        where the output goes (None: this process's own output)."""
        environment = dict(os.environ, **env, **host_env[self.group_rank], **self._torchrun_variables())
        if self.local_world_size > 1:
            environment.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks share the host's cores
        self.metrics_file = Path(metrics_file) if self.rank == 0 else None
        # What an earlier attempt logged is not progress (train.py cuts it back to its checkpoint).
        self.last_step = last_logged_step(self.metrics_file) if self.metrics_file else None
        command = [sys.executable, "-S", DIE_WITH_PARENT, str(os.getpid()), sys.executable, *argv]
        started = threading.Event()
        # The parent-death signal follows the thread that starts the child: this one lives until
        # the child has ended.
        run = (command, cwd, environment, log_file, started)
        threading.Thread(target=self._run, args=run, daemon=True).start()
        started.wait()

    def _run(self, command: list[str], cwd: str, environment: dict, log_file: str | None,
             started: threading.Event) -> None:  # fmt: skip
        try:
            output = open(log_file, "ab") if log_file else None
            with output or contextlib.nullcontext():
                streams = {"stdin": subprocess.DEVNULL, "stdout": output, "stderr": output}
                self.process = subprocess.Popen(command, cwd=cwd, env=environment, **streams,
                                                start_new_session=True)  # fmt: skip
        except OSError as e:
            self.start_error, self.ended_at = f"could not start train.py: {e}", time.time()
            return
        finally:
            started.set()
        self.process.wait()
        self.ended_at = time.time()

    def _torchrun_variables(self) -> dict[str, str]:
        hosts = self.world_size // self.local_world_size
        return {
            "RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(hosts), "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size), "ROLE_NAME": "default",
        }  # fmt: skip

    @endpoint
    def poll(self) -> RankReport:
        process = self.process
        exit_code = process.returncode if process is not None else (1 if self.start_error else None)
        step = last_logged_step(self.metrics_file) if self.metrics_file else None
        if step is not None and (self.last_step is None or step > self.last_step):
            self.progress += 1
        self.last_step = step if step is not None else self.last_step
        pid = process.pid if process is not None else None
        return RankReport(self.rank, socket.gethostname(), pid, exit_code, self.ended_at, self.last_step,
                          self.progress, self.start_error)  # fmt: skip

    @endpoint
    def send_signal(self, signum: int) -> None:
        """To train.py alone (not its session): its stop-signal handler saves and exits."""
        if self.process is not None and self.process.poll() is None:
            _signal(self.process.pid, signum)

    @endpoint
    def stop_training(self, grace_s: float) -> None:
        """SIGTERM, then after grace_s SIGKILL to train.py's whole session (helpers it started too)."""
        if self.process is None or self.process.poll() is not None:
            return
        _signal(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it has just ended
