"""Fault tolerance (torchft): replica groups give the HSDP-equivalent run; a killed group is left
behind, the other goes on, and the restarted group heals from it (scripts/fault_tolerance_local.sh,
the lighthouse and each group a real process; fp32, CPU, gloo)."""

import io
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, read_metrics, run_train

from checkpoint.state import TrainState
from configs.schema import LRScheduler, Optimizer
from training.fault_tolerance import healing_state, load_healing_state
from training.optimizer import Optimizers

ARGS = [*TINY, "--training.global_batch_size", "8", "--training.local_batch_size", "4"]


class Cursor:
    def __init__(self, position: int):
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def test_healing_state_carries_weights_moments_step_rng_and_cursor():
    """What a live group sends (through torch.save, as torchft's transport does) makes a fresh
    group's model, AdamW moments, step, RNG and data cursor the sender's: the next step is equal."""
    groups = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        optimizers = Optimizers(
            [model], Optimizer(lr=1e-2), LRScheduler(warmup_steps=0), 10, torch.device("cpu")
        )
        groups.append((model, optimizers, Cursor(seed), TrainState(model="tiny")))
    (live, live_opt, live_cursor, live_state), (fresh, fresh_opt, fresh_cursor, fresh_state) = groups
    data = torch.randn(5, 8)
    live(data).square().sum().backward()
    live_opt.step()
    live_opt.zero_grad()
    live_state.step, live_cursor.position = 7, 123
    torch.manual_seed(42)
    buffer = io.BytesIO()
    torch.save(healing_state([live], live_opt, live_cursor, live_state), buffer)
    buffer.seek(0)
    torch.manual_seed(0)
    load_healing_state(torch.load(buffer, weights_only=False), [fresh], fresh_opt, fresh_cursor, fresh_state)
    assert fresh_state.step == 7 and fresh_cursor.position == 123
    drawn = torch.rand(3)  # from the sender's RNG state
    torch.manual_seed(42)
    assert torch.equal(drawn, torch.rand(3))
    for model, optimizers in ((live, live_opt), (fresh, fresh_opt)):
        model(data).square().sum().backward()
        optimizers.step()
    for a, b in zip(live.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


# Loaded by every process the launcher starts (PYTHONPATH): in train.py, replica group 1's first
# run kills itself (SIGKILL) in the forward pass of the DIE_AT_STEP-th step that every group takes
# part in, after which a group left alone waits 0.1 s a step (on a busy machine the restarted group
# takes 10-25 s to start and must find it still training); replica group 0 kills the lighthouse
# (SIGKILL, once) in the forward pass of the KILL_LIGHTHOUSE_AT_STEP-th; at the end each group
# writes a digest of its model and optimizer state (parameters, AdamW moments and steps), with local
# SGD also one of its parameters right after each sync.
INSTRUMENT = """
import hashlib, os, signal, sys, time
if sys.argv and sys.argv[0].endswith("train.py"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    import torch
    import training.step, training.fault_tolerance as ft
    replica = sys.argv[sys.argv.index("--fault_tolerance.replica_id") + 1]
    forward_backward = training.step.StepRunner.forward_backward
    calls = [0]
    def once(name):
        marker = os.path.join(os.environ["DIGESTS"], name)
        if os.path.exists(marker):
            return False
        open(marker, "w").close()
        return True
    def kill_lighthouse():
        port = os.environ["TORCHFT_LIGHTHOUSE"].rsplit(":", 1)[1]
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                command = open(f"/proc/{pid}/cmdline").read().split("\\0")
            except OSError:
                continue
            if any(part.endswith("torchft_lighthouse") for part in command) and f"[::]:{port}" in command:
                os.kill(int(pid), signal.SIGKILL)
    def dying_forward_backward(self, micro_batches):
        calls[0] += self.fault_tolerance.participants() == self.fault_tolerance.groups
        if replica == "1" and calls[0] == int(os.environ["DIE_AT_STEP"]) and once("died"):
            os.kill(os.getpid(), signal.SIGKILL)
        alone = self.fault_tolerance.participants() < self.fault_tolerance.groups
        if alone and os.path.exists(os.path.join(os.environ["DIGESTS"], "died")):
            time.sleep(0.1)
        lighthouse_step = int(os.environ.get("KILL_LIGHTHOUSE_AT_STEP", "-1"))
        if replica == "0" and calls[0] == lighthouse_step and once("lighthouse killed"):
            kill_lighthouse()
        return forward_backward(self, micro_batches)
    training.step.StepRunner.forward_backward = dying_forward_backward
    register_state, close = ft.FaultTolerance.register_state, ft.FaultTolerance.close
    def keep(self, *parts, **named):
        self.parts = parts
        register_state(self, *parts, **named)
    def write_digest(self, name, parts):
        state = ft.healing_state(*self.parts)
        digest = hashlib.sha256()
        for part in parts:
            for key, value in sorted(state[part].items()):
                data = value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode()
                digest.update(key.encode() + data)
        with open(os.path.join(os.environ["DIGESTS"], name), "w") as f:
            f.write(digest.hexdigest())
    def digest_and_close(self):
        write_digest(self, "replica_" + replica, ("model", "optimizer"))
        close(self)
    ft.FaultTolerance.register_state, ft.FaultTolerance.close = keep, digest_and_close
    sync = ft.FaultTolerance.sync
    def digest_after_sync(self, step, last_step, on_new_state):  # local SGD: parameters after a sync
        try:
            sync(self, step, last_step, on_new_state)
        finally:
            if self.local_sgd is not None and (step % self.sync_steps == 0 or step == last_step):
                write_digest(self, f"replica_{replica}_step_{step}", ("model",))
    ft.FaultTolerance.sync = digest_after_sync
"""


def launch(folder: Path, steps: int, extra: dict, *args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", REPLICA_GROUPS="2", HEARTBEAT_MS="1000") | extra
    command = ["bash", str(REPO / "scripts/fault_tolerance_local.sh"), *ARGS, "--training.steps", str(steps),
               "--job.dump_folder", str(folder), *args]  # fmt: skip
    return subprocess.Popen(
        command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_two_replica_groups_equal_fsdp_2(tmp_path):
    """Two groups of one process each (both needed for a quorum) log the losses and grad norms of
    one FSDP 2 run with the same global batch (and its validation losses): the groups read its two
    data-parallel shares. One group writes the checkpoints, into the folder they share. The
    lighthouse is killed in step 3: the launcher starts it again, and the groups, which waited for
    it, go on from where they were (no group restarted, no step lost)."""
    folder, digests = tmp_path / "ft", tmp_path / "digests"
    digests.mkdir()
    (tmp_path / "sitecustomize.py").write_text(INSTRUMENT)
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    validation = ["--validation.enable", "--validation.freq", "5", "--validation.steps", "2",
                  "--validation.dataset", "python_docs"]  # fmt: skip
    env = {"MIN_REPLICAS": "2", "RESTARTS": "1", "DIGESTS": str(digests), "DIE_AT_STEP": "-1",
           "KILL_LIGHTHOUSE_AT_STEP": "3", "PYTHONPATH": str(tmp_path)}  # fmt: skip
    process = launch(folder, 10, env, *checkpoints, *validation)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output + (folder / "replica_0.log").read_text()[-3000:]
    assert (digests / "lighthouse killed").exists() and "lighthouse: restart 1" in output
    assert "replica group" not in output, output  # neither group was started again
    reference_run = ["--training.steps", "10", *validation, "--job.dump_folder", str(tmp_path / "fsdp2")]
    run_train([*ARGS, *reference_run], nproc=2)
    reference = read_metrics(tmp_path / "fsdp2")
    for replica in (0, 1):
        records = read_metrics(folder / f"replica_{replica}")
        kinds = lambda records: [(r["step"], "val_loss" in r) for r in records]
        assert kinds(records) == kinds(reference)
        for ours, want in zip(records, reference):
            for key, rel in (("loss", 1e-6), ("grad_norm", 1e-5), ("val_loss", 1e-6)):
                if key in want:
                    assert abs(ours[key] - want[key]) <= rel * abs(want[key]), (key, ours, want)
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-10", "step-5"]
    assert all((folder / "checkpoint" / name / "checksums.json").exists() for name in ("step-5", "step-10"))
    logs = (folder / "replica_0.log").read_text() + (folder / "replica_1.log").read_text()
    assert logs.count("saved checkpoint") == 2


@pytest.mark.slow
def test_a_lighthouse_gone_for_good_stops_each_group_with_one_error_line(tmp_path):
    """The lighthouse killed in step 3 and not started again (RESTARTS 0): each group waits
    fault_tolerance.timeout_seconds for a quorum, then stops with one `error:` line that names the
    lighthouse and what to do, and no traceback of its own (torchrun's report of the exit follows)."""
    folder, digests = tmp_path / "ft", tmp_path / "digests"
    digests.mkdir()
    (tmp_path / "sitecustomize.py").write_text(INSTRUMENT)
    env = {"RESTARTS": "0", "DIGESTS": str(digests), "DIE_AT_STEP": "-1", "KILL_LIGHTHOUSE_AT_STEP": "3",
           "PYTHONPATH": str(tmp_path)}  # fmt: skip
    process = launch(folder, 1000, env, "--fault_tolerance.timeout_seconds", "3")
    output, _ = process.communicate(timeout=300)
    logs = [(folder / f"replica_{i}.log").read_text() for i in (0, 1)]
    assert process.returncode == 1 and (digests / "lighthouse killed").exists(), output + logs[0][-3000:]
    for replica, log in enumerate(logs):
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert errors == [
            f"error: the torchft lighthouse at http://localhost:29510 is unreachable: replica group "
            f"{replica} waited fault_tolerance.timeout_seconds = 3 s for it and stops. Start the lighthouse "
            "again at that address, then this group: it continues from a live group's state or the latest "
            "checkpoint (scripts/fault_tolerance_local.sh restarts both)"
        ], log[-3000:]
        assert "Traceback" not in log[: log.index(errors[0])], log[-3000:]


@pytest.mark.slow
def test_killed_group_is_left_behind_and_heals_from_the_live_one(tmp_path):
    """Group 1 is SIGKILLed in the middle of the 20th step both groups take: group 0 does not commit
    that step and goes on alone (no restart, every step logged once from its first; a group that
    starts later than the other heals at its first step, so its first record may be past step 10);
    the launcher starts group 1 again, which copies group 0's state and finishes in step with it:
    at the end both hold bitwise the same parameters and AdamW state."""
    folder, digests = tmp_path / "ft", tmp_path / "digests"
    digests.mkdir()
    (tmp_path / "sitecustomize.py").write_text(INSTRUMENT)
    steps = 400
    env = {"RESTARTS": "1", "DIGESTS": str(digests), "DIE_AT_STEP": "20", "PYTHONPATH": str(tmp_path)}
    process = launch(folder, steps, env, "--metrics.log_freq", "10")
    output, _ = process.communicate(timeout=300)
    logs = [(folder / f"replica_{i}.log").read_text() for i in (0, 1)]
    assert process.returncode == 0, output + logs[0][-2000:] + logs[1][-3000:]
    assert (digests / "died").exists() and "replica group 1: restart 1" in output
    # The loss of group 1 is one warning (torchft's traceback of the broken collective dropped), and
    # no log has torchft's empty lines (its records for OpenTelemetry) or its CPU-only warning.
    lost = (
        "replica group 1 was lost during the last step (not committed, it runs again): the other groups go on"
    )
    # (Group 0, when it started after group 1, healed at its first step: that line is not the loss's.)
    said = [
        line[9:] for line in logs[0].splitlines() if "replica group" in line and "healed from" not in line
    ]
    assert said == [f"{lost} without it"]
    assert all(
        int(step) < 20
        for step in re.findall(r"healed from a live replica group: continuing after step (\d+)", logs[0])
    )
    assert "Traceback" not in logs[0], logs[0][-3000:]
    for log in logs:
        assert not re.search(r"^\d\d:\d\d:\d\d $", log, re.MULTILINE) and "flight recorder" not in log
    healed = re.findall(r"healed from a live replica group: continuing after step (\d+)", logs[1])
    assert healed and int(healed[-1]) > 20, logs[1][-3000:]
    survivor = [r["step"] for r in read_metrics(folder / "replica_0")]
    assert survivor == list(range(survivor[0], steps + 1, 10))  # never restarted, nothing redone
    rejoined = [r["step"] for r in read_metrics(folder / "replica_1")]
    assert rejoined == sorted(set(rejoined)) and rejoined[-1] == steps  # its records continue after the gap
    assert (digests / "replica_0").read_text() == (digests / "replica_1").read_text()


@pytest.mark.slow
def test_local_sgd_groups_train_alone_and_hold_the_same_weights_after_each_sync(tmp_path):
    """semi_sync_method local_sgd, a sync every 4 of 10 steps (and after the last): each group trains
    on its own samples (its loss is its own, normalized by its tokens), right after every sync both
    hold bitwise the same parameters while their AdamW moments stay their own; one group saves,
    right after syncs."""
    folder, digests = tmp_path / "ft", tmp_path / "digests"
    digests.mkdir()
    (tmp_path / "sitecustomize.py").write_text(INSTRUMENT)
    env = {"MIN_REPLICAS": "2", "RESTARTS": "0", "DIGESTS": str(digests), "DIE_AT_STEP": "-1",
           "PYTHONPATH": str(tmp_path)}  # fmt: skip
    local_sgd = ["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "4"]
    process = launch(folder, 10, env, *local_sgd, "--checkpoint.enable", "--checkpoint.interval", "8")
    output, _ = process.communicate(timeout=300)
    logs = [(folder / f"replica_{i}.log").read_text() for i in (0, 1)]
    assert process.returncode == 0, output + logs[0][-3000:] + logs[1][-3000:]
    for step in (4, 8, 10):
        assert (digests / f"replica_0_step_{step}").read_text() == (
            digests / f"replica_1_step_{step}"
        ).read_text()
    assert (digests / "replica_0").read_text() != (digests / "replica_1").read_text()  # own moments
    losses = [[r["loss"] for r in read_metrics(folder / f"replica_{i}")] for i in (0, 1)]
    assert len(losses[0]) == len(losses[1]) == 10 and losses[0] != losses[1]
    assert min(losses[0][0], losses[1][0]) > 5.0  # a mean over the group's own tokens (log 320 = 5.8)
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-10", "step-8"]
    assert (logs[0] + logs[1]).count("saved checkpoint") == 2
