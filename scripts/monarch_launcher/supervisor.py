"""The controller's loop: start every replica group, poll them, restart a failed one, forward stop
signals, and decide the exit code.

A group fails when one of its train.py processes exits non-zero or is killed, when Monarch reports
that one of its actor processes died (a supervision event, through unhandled_fault_hook, whose
default would end the controller), when its actors stop answering, or, with --hang-timeout S,
when rank 0 logs no new step for S seconds after its first one. Every process of the group is
then stopped (SIGTERM, SIGKILL after a grace period), its mesh torn down, and a new mesh started,
up to --max-restarts times: train.py resumes by itself from the latest complete checkpoint (with
fault tolerance the restarted group heals from a live one; the others train on). A train.py that
exits with code 2 (a mistake in its arguments or config: its own `error:` line says which) is not
restarted: it would fail the same way.

SIGTERM, SIGUSR1 and Ctrl-C reach every train.py as SIGTERM (each finishes its step, saves a
checkpoint and exits 0; training/stop_signals.py); the controller waits for them and exits 0, or
130 after Ctrl-C. A Ctrl-C after that kills them at once. A stop while the scheduler has not yet
given the hosts ends the launch there.
"""

import dataclasses
import signal
import sys
import threading
import time
import uuid

from monarch import actor as monarch_actor

from scripts.monarch_launcher.command_line import Launch
from scripts.monarch_launcher.lighthouse import start_lighthouse
from scripts.monarch_launcher.progress import latest_checkpoint_step
from scripts.monarch_launcher.replica_group import UNRESPONSIVE_S, ReplicaGroup, describe_exit
from scripts.monarch_launcher.schedulers import allocate

POLL_INTERVAL_S = 0.5
INTERRUPTED = 128 + signal.SIGINT
USER_MISTAKE = 2  # train.py's exit code for a mistake in its arguments or config


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} launch_monarch: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Failure:
    cause: str  # for the log and the `error:` line: which rank and how it ended, or why it is hung
    exit_code: int | None = None  # of the train.py that ended first (None: no train.py exit)


class Stopped(BaseException):
    """A stop signal while waiting for the hosts: nothing to save, the launch just ends (a
    BaseException, as KeyboardInterrupt: no `except Exception` on the way swallows it)."""


class StopRequests:
    """SIGTERM, SIGUSR1 and Ctrl-C: remembered here and acted on by the loop; while waiting for the
    hosts (`interrupting`) they end the wait."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.kill_now = False  # a second Ctrl-C
        self.interrupting = False
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.name is not None:
            self.kill_now = True
        self.name = self.name or signal.Signals(signum).name
        if self.interrupting:
            self.interrupting = False
            raise Stopped

    @property
    def exit_code(self) -> int:
        return INTERRUPTED if self.name == "SIGINT" else 0


class MeshFailures:
    """Monarch's supervision events (an actor's process died), kept by actor mesh name. Installed
    as monarch.actor.unhandled_fault_hook, whose default ends the controller with exit code 1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, str] = {}
        monarch_actor.unhandled_fault_hook = self.record

    def record(self, failure) -> None:
        """Called on a Monarch thread; it must not raise (Monarch would then interrupt the main
        thread, as Ctrl-C does)."""
        try:
            mesh = failure.mesh_name.rsplit("-", 1)[0]  # Monarch appends a suffix to the name given
            report = " ".join(str(failure.report()).split())[:300]
            with self._lock:
                self._failures.setdefault(mesh, f"an actor process died (Monarch supervision: {report})")
        except BaseException:  # noqa: BLE001 - the polls still see the mesh stop answering
            pass

    def of(self, mesh_name: str) -> str | None:
        with self._lock:
            return self._failures.get(mesh_name)


class Supervisor:
    def __init__(self, launch: Launch):
        self.launch = launch
        self.stops = StopRequests()
        self.failures = MeshFailures()
        self.environment: dict[str, str] = {}  # for every train.py
        self.groups: list[ReplicaGroup] = []
        self.error: str | None = None  # the `error:` line to end with
        self.exit_code: int | None = None  # set once the job has failed

    def run(self) -> int:
        lighthouse, release = None, lambda: None
        try:
            if self.launch.fault_tolerance:
                lighthouse, address = start_lighthouse(self.launch.min_replicas, self.launch.dump_folder,
                                                       local=self.launch.scheduler == "local")  # fmt: skip
                self.environment["TORCHFT_LIGHTHOUSE"] = address
            self.stops.interrupting = True
            if self.stops.name:
                raise Stopped
            hosts, release = allocate(self.launch)
            self.stops.interrupting = False
            run_id = f"monarch-{uuid.uuid4().hex[:8]}"
            self.groups = [ReplicaGroup(g, self.launch, hosts[g], run_id) for g in range(len(hosts))]
            for group in self.groups:
                self._start(group)
            self._supervise()
        except Stopped:
            log(f"{self.stops.name} before training started: nothing to save")
        finally:
            for group in self.groups:
                group.tear_down()
            release()
            if lighthouse is not None:
                lighthouse.kill()
                lighthouse.wait()
        if self.error:
            print(f"error: {self.error}", file=sys.stderr, flush=True)
        return self.exit_code if self.exit_code is not None else self.stops.exit_code

    def _start(self, group: ReplicaGroup) -> None:
        """A new mesh for the group; a stop signal before it means none, a failure ends the job."""
        if self.stops.name or self.exit_code is not None:
            group.finished = True
            return
        try:
            port = group.start(self.environment)
        except Exception as e:  # noqa: BLE001 - Monarch could not spawn (a lost host, say): say so, end
            group.tear_down()
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return self._fail(f"{group.name}: could not start its processes: {reason}", 1)
        processes, hosts = self.launch.nproc_per_host * self.launch.hosts, self.launch.hosts
        where = f"{plural(processes, 'process')} on {plural(hosts, 'host')} ({self.launch.scheduler})"
        output = f", output in {group.log_file()}" if group.log_file() else ""
        log(f"{group.name}: {where}, attempt {group.attempt.number}, MASTER_PORT {port}{output}")

    def _supervise(self) -> None:
        forwarded = False
        while not all(group.finished for group in self.groups):
            if self.stops.kill_now:
                log("Ctrl-C again: killing the training processes")
                for group in self.groups:
                    group.kill()
                self.exit_code = INTERRUPTED
                return
            if self.stops.name and not forwarded:
                again = " (Ctrl-C again to kill them at once)" if self.stops.name == "SIGINT" else ""
                log(f"{self.stops.name}: the training processes stop after their step, saving a checkpoint "
                    f"if enabled{again}")  # fmt: skip
                for group in self.groups:
                    if not group.finished:
                        group.send_signal(signal.SIGTERM)
                forwarded = True
            for group in self.groups:
                if not group.finished:
                    self._check(group)
            time.sleep(POLL_INTERVAL_S)

    def _check(self, group: ReplicaGroup) -> None:
        """Poll one group; on a failure restart it, or end the job."""
        reports = group.poll()
        failure = self._failure(group, reports, time.time())
        if failure is None:
            if reports is not None and all(report.exit_code == 0 for report in reports):
                group.finished = True
                group.tear_down()
            return
        if not self.stops.name and failure.exit_code != USER_MISTAKE:
            log(f"{group.name}: {failure.cause}: stopping its processes")
        group.tear_down()
        if self.stops.name:  # nothing is restarted; SIGTERM before train.py's handler is a stop too
            group.finished = True
            if failure.exit_code != -signal.SIGTERM:
                self._fail(f"{group.name}: {failure.cause} while stopping", 1)
        elif failure.exit_code == USER_MISTAKE:
            self._fail(None, USER_MISTAKE)  # train.py's own `error:` line says what to fix
        elif group.restarts >= self.launch.max_restarts:
            self._fail(f"{group.name}: {failure.cause}; no restart left (--max-restarts {group.restarts})", 1)
        else:
            group.restarts += 1
            restart = f"restart {group.restarts} of {self.launch.max_restarts}"
            log(f"{group.name}: {restart}: {self._resume_point()}")
            self._start(group)

    def _failure(self, group: ReplicaGroup, reports: list | None, now: float) -> Failure | None:
        """Why the group failed, or None while it trains (or has finished)."""
        if supervision := self.failures.of(group.mesh_name):
            return Failure(supervision)
        attempt = group.attempt
        if reports is None:
            silent = now - attempt.last_answer_at
            if silent > UNRESPONSIVE_S:
                return Failure(f"its actors did not answer for {silent:.0f} s")
            return None
        ended = [report for report in reports if report.exit_code not in (None, 0)]
        if ended:
            first = min(ended, key=lambda report: report.ended_at or now)  # the others followed it
            return Failure(describe_exit(first), first.exit_code)
        attempt.note_progress(reports[0], now)
        timeout = self.launch.hang_timeout_s
        if timeout is None or self.stops.name or attempt.stalled_for(now) <= timeout:
            return None  # (and no hang while stopping: a stop's save takes the time it takes)
        return Failure(f"no progress for {timeout:g} s (last logged step {attempt.last_step})")

    def _fail(self, error: str | None, code: int) -> None:
        """End the job: every group stops (SIGTERM, then SIGKILL); the controller exits with code."""
        for group in self.groups:
            group.tear_down()
            group.finished = True
        self.error, self.exit_code = error, code

    def _resume_point(self) -> str:
        enabled = self.launch.config.checkpoint.enable
        step = latest_checkpoint_step(self.launch.checkpoint_folder) if enabled else None
        checkpoint = f"checkpoint step {step}" if step is not None else "no complete checkpoint: step 0"
        if self.launch.fault_tolerance:
            return f"it heals from a live replica group at its first quorum (with none live: {checkpoint})"
        return (
            f"train.py resumes from {checkpoint}"
            if step is not None
            else f"train.py starts over ({checkpoint})"
        )


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('s') else 's'}"
