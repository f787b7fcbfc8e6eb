"""Start-up and restart times of scripts/launch_monarch.py against torchrun, on CPU: the tiny model
(tests/tiny.toml), 2 ranks, one thread each.

    python benchmarks/monarch_launch_cpu.py --repeats 3 --out /tmp/monarch_launch

Prints one JSON line per run. "to_step_1_s": seconds from starting the launcher to rank 0's line
"step 1 done ... after start" (train.py logs it when its first step ends); "total_s": to the
launcher's exit (4 steps); "to_train_py_s": to the controller's line saying the mesh is up and its
actors have started train.py. The two launchers alternate, so a busy machine slows both alike.
Then, per repeat, a launcher run with --max-restarts 1 whose rank 1 gets SIGKILL right after
checkpoint step-2 is complete; from that SIGKILL: "noticed_s" (the failure logged), "torn_down_s"
(the old mesh stopped), "new_mesh_s" (the new mesh's train.py started), "kill_to_step_s" (the
restarted job's first step ended: the next "done ... after start" line).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["--config", str(REPO / "tests" / "tiny.toml"), "--training.global_batch_size", "8"]
FIRST_STEP = re.compile(r"step \d+ done .* after start")


class Run:
    """A command whose output lines are timestamped as they come."""

    def __init__(self, command: list[str]):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.perf_counter(), line.rstrip()))

    def first_steps(self) -> list[float]:
        """When each process start's first step ended (train.py's 'done ... after start' line)."""
        return [at for at, line in self.lines if FIRST_STEP.search(line)]

    def seen(self, text: str, after: float = 0.0) -> float:
        """When the first line holding text came, after a moment."""
        return next(at for at, line in self.lines if at > after and text in line)

    def wait(self) -> float:
        code = self.process.wait(timeout=600)
        self.reader.join()
        if code != 0:
            sys.exit("\n".join(line for _, line in self.lines[-40:]))
        return time.perf_counter() - self.started


def rank_1_trainer(root: int) -> int | None:
    """The train.py of RANK=1 among root's descendants."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and "train.py" in (entry / "cmdline").read_text():
                if b"RANK=1\0" in (entry / "environ").read_bytes() and descends(int(entry.name), root):
                    return int(entry.name)
        except OSError:
            continue
    return None


def descends(pid: int, root: int) -> bool:
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == root:
            return True
    return False


def start_up(launcher: str, folder: Path) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    args = [*TRAIN, "--training.steps", "4", "--job.dump_folder", str(folder)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(REPO / "train.py"), *args]  # fmt: skip
    else:
        command = [
            sys.executable,
            str(REPO / "scripts" / "launch_monarch.py"),
            "--nproc-per-host",
            "2",
            "--",
            *args,
        ]
    run = Run(command)
    total = run.wait()
    times = {"to_step_1_s": run.first_steps()[0] - run.started, "total_s": total}
    if launcher == "launch_monarch":  # the mesh spawned, its actors started train.py
        times["to_train_py_s"] = run.seen("attempt 0, MASTER_PORT") - run.started
    return {"launcher": launcher, **{key: round(value, 2) for key, value in times.items()}}


def restart(folder: Path) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    args = [*TRAIN, "--training.steps", "30", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--job.dump_folder", str(folder)]  # fmt: skip
    run = Run([sys.executable, str(REPO / "scripts" / "launch_monarch.py"), "--nproc-per-host", "2",
               "--max-restarts", "1", "--", *args])  # fmt: skip
    while not (folder / "checkpoint" / "step-2").exists():
        time.sleep(0.01)
    victim = rank_1_trainer(run.process.pid)
    os.kill(victim, signal.SIGKILL)
    killed = time.perf_counter()
    run.wait()
    times = {
        "kill_to_step_s": min(at for at in run.first_steps() if at > killed),
        "noticed_s": run.seen("stopping its processes", killed),  # the failure seen
        "torn_down_s": run.seen("restart 1 of 1", killed),  # the old mesh stopped
        "new_mesh_s": run.seen("attempt 1, MASTER_PORT", killed),  # the new mesh's train.py started
    }
    return {"launcher": "launch_monarch", **{key: round(at - killed, 2) for key, at in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="/tmp/monarch_launch", help="folder for the runs' dump folders")
    args = parser.parse_args()
    out = Path(args.out)
    for repeat in range(args.repeats):
        for launcher in ("torchrun", "launch_monarch"):
            print(json.dumps({"repeat": repeat, **start_up(launcher, out / launcher)}), flush=True)
        print(json.dumps({"repeat": repeat, **restart(out / "restart")}), flush=True)


if __name__ == "__main__":
    main()
