"""The Monarch launcher (scripts/launch_monarch.py, docs/monarch.md) on CPU: a killed rank and a
dead actor process are restarted and the run ends with the losses of an uninterrupted one; a stop
signal saves and exits 0, and a killed controller leaves no process behind; replica groups
outlive one group's death; the Slurm job and Kubernetes meshes it would ask for; mistakes end in
one `error:` line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, descendants, read_metrics

LAUNCHER = [sys.executable, str(REPO / "scripts" / "launch_monarch.py")]
# The shared single-process reference of tests/test_parallel.py: the same global batch of 8 (here
# 2 ranks x 4), so the runs compare step by step.
REFERENCE = [*TINY, "--training.steps", "6", "--training.global_batch_size", "8", "--model.name", "llama3",
             "--training.local_batch_size", "8"]  # fmt: skip
GLOBAL_BATCH_8 = [*TINY, "--training.global_batch_size", "8"]

# Loaded by every process the launcher starts (PYTHONPATH): in train.py, KILLS lists
# `attempt,replica group,rank,path,whom;...`: that rank of that attempt (TORCHELASTIC_RESTART_COUNT)
# SIGKILLs itself ("self") or its actor's process ("actor") as soon as `path` exists.
INSTRUMENT = """
import os, signal, sys, threading, time
if sys.argv and sys.argv[0].endswith("train.py"):
    replica_id = "--fault_tolerance.replica_id"
    group = sys.argv[sys.argv.index(replica_id) + 1] if replica_id in sys.argv else "0"
    me = (os.environ.get("TORCHELASTIC_RESTART_COUNT"), group, os.environ.get("RANK"))
    for kill in filter(None, os.environ.get("KILLS", "").split(";")):
        attempt, replica_group, rank, path, whom = kill.split(",")
        if me == (attempt, replica_group, rank):
            def watch(path=path, victim=os.getpid() if whom == "self" else os.getppid()):
                while not os.path.exists(path):
                    time.sleep(0.01)
                os.kill(victim, signal.SIGKILL)
            threading.Thread(target=watch, daemon=True).start()
"""


def launch(tmp_path: Path, options: list[str], train: list[str], kills: str = "") -> subprocess.Popen:
    """The launcher on train.py's arguments, in a session of its own, output in one pipe."""
    (tmp_path / "sitecustomize.py").write_text(INSTRUMENT)
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(tmp_path),
                       KILLS=kills)  # fmt: skip
    environment.pop("WORLD_SIZE", None)
    command = [*LAUNCHER, *options, "--", *train]
    return subprocess.Popen(command, cwd=REPO, env=environment, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def finish(process: subprocess.Popen, timeout: int = 300) -> str:
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(
            f"the launcher did not end in {timeout} s:\n{process.communicate()[0][-5000:]}"
        ) from None


def left_behind(folder: Path) -> list[str]:
    """Processes still running whose command line names folder (train.py of this test)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if entry.name.isdigit() and str(folder) in command and state != "Z":
                found.append(f"{entry.name}: {command}")
        except OSError:
            continue
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert process.poll() is None and time.time() < deadline, f"no {path}:\n{finish(process)[-5000:]}"
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_rank_and_dead_actor_are_restarted_with_the_losses_of_one_run(tmp_path, single_process_runs):
    """Two ranks, a checkpoint every 2 steps: rank 1 is SIGKILLed right after step-2 is saved (its
    train.py exits), then in the second attempt rank 0's actor process is SIGKILLed after step-4
    (a Monarch supervision event; its train.py dies with it). Each time the job starts again on a
    new mesh from the latest checkpoint; the log names the cause and the step, and metrics.jsonl
    ends with the losses of one uninterrupted single-process run."""
    folder = tmp_path / "run"
    checkpoints = folder / "checkpoint"
    kills = f"0,0,1,{checkpoints / 'step-2'},self;1,0,0,{checkpoints / 'step-4'},actor"
    train = [*GLOBAL_BATCH_8, "--training.steps", "6", "--model.name", "llama3", "--checkpoint.enable",
             "--checkpoint.interval", "2", "--job.dump_folder", str(folder)]  # fmt: skip
    process = launch(tmp_path, ["--nproc-per-host", "2", "--max-restarts", "2"], train, kills)
    output = finish(process)
    assert process.returncode == 0, output[-6000:]
    assert "job: rank 1 (" in output and ") was killed by SIGKILL: stopping its processes" in output
    assert "job: restart 1 of 2: train.py resumes from checkpoint step 2" in output
    assert "job: an actor process died (Monarch supervision:" in output
    assert "job: restart 2 of 2: train.py resumes from checkpoint step 4" in output
    records, reference = read_metrics(folder), single_process_runs(REFERENCE)
    assert [r["step"] for r in records] == [r["step"] for r in reference] == list(range(1, 7))
    for ours, want in zip(records, reference):
        assert ours["loss"] == pytest.approx(want["loss"], rel=1e-5), (ours, want)
    assert not left_behind(folder)


@pytest.mark.slow
def test_stop_signal_saves_and_exits_0_and_a_killed_controller_leaves_no_process(tmp_path):
    """SIGTERM to the controller: every rank saves after its step and exits 0, so does the
    controller, and nothing is left. Launched again, SIGKILL to the controller takes its actor
    processes and their train.py with it."""
    folder = tmp_path / "run"
    train = [*GLOBAL_BATCH_8, "--training.steps", "4000", "--checkpoint.enable", "--checkpoint.interval",
             "1000", "--job.signal_check_interval", "1", "--job.dump_folder", str(folder)]  # fmt: skip
    process = launch(tmp_path, ["--nproc-per-host", "2"], train)
    wait_for(folder / "metrics.jsonl", process)
    started = descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    output = finish(process)
    assert process.returncode == 0, output[-5000:]
    step = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped by SIGTERM after step {step}: saved {folder / 'checkpoint' / f'step-{step}'}" in output
    assert "Traceback" not in output and not left_behind(folder)
    assert all(not Path(f"/proc/{pid}").exists() for pid in started)

    process = launch(tmp_path, ["--nproc-per-host", "2"], train)
    deadline = time.time() + 120
    while len([pid for pid in descendants(process.pid) if "train.py" in command_line(pid)]) < 2:
        assert process.poll() is None and time.time() < deadline, finish(process)[-5000:]
        time.sleep(0.05)
    started = descendants(process.pid)  # the actors' processes and their train.py
    process.kill()
    finish(process)
    time.sleep(2)  # parent-death signals: Monarch's for its processes, die_with_parent.py's for train.py
    assert all(not Path(f"/proc/{pid}").exists() for pid in started), left_behind(folder)


@pytest.mark.slow
def test_replica_groups_outlive_one_group_and_only_it_restarts(tmp_path):
    """Two torchft replica groups of one process (both needed for a quorum): group 1 is SIGKILLed
    after its first step; group 0 keeps its process and waits in its quorum, group 1 alone is
    started again, heals from group 0, and both finish."""
    folder = tmp_path / "run"
    train = [*GLOBAL_BATCH_8, "--training.steps", "12", "--training.local_batch_size", "4",
             "--job.dump_folder", str(folder)]  # fmt: skip
    kills = f"0,1,0,{folder / 'replica_1' / 'metrics.jsonl'},self"  # after its first logged step
    options = ["--nproc-per-host", "1", "--replica-groups", "2", "--min-replicas", "2", "--max-restarts", "1"]
    process = launch(tmp_path, options, train, kills)
    output = finish(process)
    logs = [(folder / f"replica_{group}.log").read_text() for group in (0, 1)]
    assert process.returncode == 0, output + logs[1][-3000:]
    assert "replica group 1: rank 0 (" in output and ") was killed by SIGKILL" in output
    assert "replica group 1: restart 1 of 1: it heals from a live replica group" in output
    assert "replica group 0: restart" not in output and output.count("replica group 0: 1 process") == 1
    assert "healed from a live replica group" in logs[1]
    for group in (0, 1):
        assert read_metrics(folder / f"replica_{group}")[-1]["step"] == 12
    assert not left_behind(folder)


def test_slurm_job_it_would_submit(tmp_path):
    """--scheduler slurm hands Monarch's SlurmJob one sbatch script for every group's hosts; here a
    fake sbatch keeps it and squeue reports the job FAILED (nothing runs): the launcher cancels it
    and ends in one `error:` line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {"sbatch": f'cat > {tmp_path}/job.sh; echo "Submitted batch job 4242"',
             "squeue": """echo '{"jobs": [{"job_state": ["FAILED"]}]}'""",
             "scancel": f'echo "$@" > {tmp_path}/cancelled'}  # fmt: skip
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    options = ["--scheduler", "slurm", "--hosts", "2", "--nproc-per-host", "8", "--gpus-per-host", "8",
               "--partition", "gpu", "--time-limit", "24:00:00", "--worker-port", "23456",
               "--sbatch-arg=--mem=0"]  # fmt: skip
    slurm_tools = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    command = [*LAUNCHER, *options, "--", *TINY, "--job.dump_folder", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=slurm_tools)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        "error: the slurm job did not start: SLURM job is no longer active"
    ), result.stderr
    script = (tmp_path / "job.sh").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=24:00:00", "#SBATCH --mem=0",
                 f"#SBATCH --output={tmp_path / 'run'}/slurm_%j_"):  # fmt: skip
        assert line in script, script
    worker = script.splitlines()[-1]
    assert worker.startswith(f"srun env PYTHONPATH={REPO} {sys.executable} -c ") and "tcp://" in worker
    assert "run_worker_loop_forever" in worker and ":23456" in worker
    assert (tmp_path / "cancelled").read_text().strip() == "4242"


@pytest.mark.parametrize(
    "options, train, error",
    [
        (["--nproc-per-host", "2"], None, "error: put train.py's arguments after --"),
        (["--nproc-per-host", "2", "--max-restarts", "1", "--"], TINY,
         "error: --max-restarts 1 without --checkpoint.enable"),
        (["--nproc-per-host", "0", "--"], TINY, "error: --nproc-per-host must be at least 1, got 0"),
        (["--nproc-per-host", "1", "--"], [*TINY, "--training.stepz", "3"], "error: "),
    ],
)  # fmt: skip
def test_mistakes_end_in_one_error_line(options, train, error):
    result = subprocess.run([*LAUNCHER, *options, *(train or [])], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == "", result
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(error), result.stderr


def test_without_torchmonarch_one_error_line(tmp_path):
    """torchmonarch is optional for training; the launcher without it says how to install it."""
    (tmp_path / "monarch").mkdir()
    (tmp_path / "monarch" / "__init__.py").write_text("raise ImportError('No module named monarch')\n")
    result = subprocess.run([*LAUNCHER, "--nproc-per-host", "2", "--", *TINY], cwd=REPO, capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))  # fmt: skip
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: the Monarch launcher needs torchmonarch: pip install torchmonarch==0.7.0 "
        "(No module named monarch)"
    ], result.stderr


def test_kubernetes_meshes_it_would_create(monkeypatch):
    """--scheduler kubernetes asks Monarch's KubernetesJob for one MonarchMesh per replica group
    (the operator makes the pods); here the cluster's API only records what it is sent. Needs the
    kubernetes client, which training does not."""
    pytest.importorskip("kubernetes")
    from kubernetes import client
    from kubernetes.client.rest import ApiException
    from monarch._src.job.kubernetes import KubeConfig

    from scripts.monarch_launcher.command_line import parse
    from scripts.monarch_launcher.schedulers import kubernetes_job

    created = []
    monkeypatch.setattr(KubeConfig, "load", lambda self: None)
    monkeypatch.setattr(client.CustomObjectsApi, "get_namespaced_custom_object",
                        lambda self, **kwargs: (_ for _ in ()).throw(ApiException(status=404)))  # fmt: skip
    monkeypatch.setattr(client.CustomObjectsApi, "create_namespaced_custom_object",
                        lambda self, **kwargs: created.append(kwargs))  # fmt: skip
    options = ["--scheduler", "kubernetes", "--namespace", "training", "--image", "registry/recipes:1",
               "--hosts", "2", "--nproc-per-host", "8", "--gpus-per-host", "8",
               "--replica-groups", "2"]  # fmt: skip
    kubernetes_job(parse([*options, "--", *TINY])).apply()
    assert [(c["namespace"], c["body"]["kind"], c["body"]["metadata"]["name"]) for c in created] == [
        ("training", "MonarchMesh", "group0"), ("training", "MonarchMesh", "group1")
    ]  # fmt: skip
    spec = created[0]["body"]["spec"]
    container = spec["podTemplate"]["spec"]["containers"][0]
    assert spec["replicas"] == 2 and container["image"] == "registry/recipes:1"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert "run_worker_loop_forever" in container["command"][-1]
