"""One replica group's processes for one attempt: a Monarch process mesh of hosts x nproc-per-host,
a TrainerActor on each process, and their train.py ranks. Without fault tolerance the job is one
group; with it each group is its own mesh (its own MASTER_PORT), restarted on its own."""

import dataclasses
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

from scripts.monarch_launcher.command_line import Launch
from scripts.monarch_launcher.schedulers import Hosts
from scripts.monarch_launcher.trainer_actor import RankReport, TrainerActor

REPO = Path(__file__).resolve().parent.parent.parent
ANSWER_TIMEOUT_S = 2.0  # a poll the actors do not answer in this time is retried
UNRESPONSIVE_S = 60.0  # no answer for this long (and no Monarch supervision event): a failure
STOP_GRACE_S = 10.0  # after a failure, SIGTERM then SIGKILL: peers of a dead rank rarely finish a step


@dataclasses.dataclass
class Attempt:
    """What the controller knows of a running attempt."""

    number: int
    last_answer_at: float
    progress: int = 0  # rank 0's count of newly logged steps
    progress_at: float | None = None  # when it last rose (None: no step logged yet)
    last_step: int | None = None

    def note_progress(self, rank0: RankReport, now: float) -> None:
        if rank0.progress != self.progress:
            self.progress, self.progress_at, self.last_step = rank0.progress, now, rank0.last_step

    def stalled_for(self, now: float) -> float:
        """Seconds since the last newly logged step (0 before the first)."""
        return 0.0 if self.progress_at is None else now - self.progress_at


class ReplicaGroup:
    def __init__(self, index: int, launch: Launch, hosts: Hosts, run_id: str):
        self.index, self.launch, self.hosts, self.run_id = index, launch, hosts, run_id
        self.restarts = 0
        self.finished = False
        self.procs = self.actors = None
        self.attempt: Attempt | None = None
        self.mesh_name = ""

    @property
    def name(self) -> str:
        return f"replica group {self.index}" if self.launch.fault_tolerance else "job"

    def start(self, environment: dict[str, str]) -> int:
        """A new mesh and its train.py ranks; returns the MASTER_PORT chosen for them."""
        number = self.restarts
        self.procs = self.hosts.spawn_procs(self.launch.nproc_per_host)
        # Unique per attempt: a supervision event of a mesh torn down before is recognized as old.
        self.mesh_name = f"trainers{self.index}x{number}x{uuid.uuid4().hex[:6]}"
        self.actors = self.procs.spawn(self.mesh_name, TrainerActor)
        first = self.actors.slice(**dict.fromkeys(self.procs.sizes, 0))
        master_addr, master_port = first.rendezvous_address.call_one(self.hosts.local).get()
        env = {**environment, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
               "TORCHELASTIC_RUN_ID": f"{self.run_id}-{self.index}",
               "TORCHELASTIC_RESTART_COUNT": str(number),
               "TORCHELASTIC_MAX_RESTARTS": str(self.launch.max_restarts)}  # fmt: skip
        argv = [str(REPO / "train.py"), *self.launch.group_args(self.index)]
        if number > 0 and self.launch.config.checkpoint.load_step != -1:
            argv.append("--checkpoint.load_step=-1")  # a restart continues from the latest checkpoint
        metrics_file, log_file = str(self.launch.metrics_file(self.index)), self.log_file()
        self.actors.start.call(argv, os.getcwd(), env, self._host_env(), metrics_file, log_file).get()
        self.attempt = Attempt(number, time.time())
        return master_port

    def log_file(self) -> str | None:
        """With replica groups each group's output goes to <dump_folder>/replica_<id>.log, as
        scripts/fault_tolerance_local.sh writes it (on the terminal the groups' lines would mix)."""
        if not self.launch.fault_tolerance:
            return None
        self.launch.dump_folder.mkdir(parents=True, exist_ok=True)
        return str(self.launch.dump_folder / f"replica_{self.index}.log")

    def _host_env(self) -> list[dict[str, str]]:
        """Per host of the mesh: on a local machine with GPUs, each group (and simulated host) gets
        its own nproc-per-host GPUs, as scripts/fault_tolerance_local.sh splits them."""
        if not self.hosts.local or not shutil.which("nvidia-smi"):
            return [{} for _ in range(self.launch.hosts)]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(1024)]
        per_host = self.launch.nproc_per_host
        first = self.index * self.launch.hosts
        return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[(first + h) * per_host:(first + h + 1) * per_host])}
                for h in range(self.launch.hosts)]  # fmt: skip

    def poll(self) -> list[RankReport] | None:
        """Every rank's report, or None if the actors did not answer in time (a dead process: its
        Monarch supervision event follows)."""
        try:
            reports = [report for _, report in self.actors.poll.call().get(timeout=ANSWER_TIMEOUT_S).items()]
        except TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - Monarch's SupervisionError: the hook has the cause
            return None
        self.attempt.last_answer_at = time.time()
        return sorted(reports, key=lambda report: report.rank)

    def send_signal(self, signum: int) -> None:
        try:
            self.actors.send_signal.call(signum).get(timeout=ANSWER_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a rank whose process is gone cannot be signalled
            pass

    def tear_down(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to every train.py still running, SIGKILL after grace_s, then the mesh stops (a
        rank whose actor process is gone went with it: die_with_parent.py)."""
        if self.procs is None:
            return
        try:
            self.actors.stop_training.call(grace_s).get(timeout=grace_s + ANSWER_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - some process is gone; stopping the mesh ends the rest
            pass
        try:
            self.procs.stop().get(timeout=30)
        except Exception as e:  # noqa: BLE001 - tell, and go on: the processes die with the controller
            print(f"launch_monarch: stopping the mesh of {self.name}: {e}", file=sys.stderr)
        self.procs = self.actors = None

    def kill(self) -> None:
        """At once (Ctrl-C while stopping): every train.py of the group gets SIGKILL right after
        its SIGTERM."""
        self.tear_down(grace_s=0.0)


def describe_exit(report: RankReport) -> str:
    if report.start_error:
        return f"rank {report.rank} ({report.host}): {report.start_error}"
    if report.exit_code is not None and report.exit_code < 0:
        return f"rank {report.rank} ({report.host}) was killed by {signal_name(-report.exit_code)}"
    return f"rank {report.rank} ({report.host}) exited with code {report.exit_code}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
