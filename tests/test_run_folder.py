"""One run per folder (training/run_folder.py): the README's commands run again, extended and cut;
the lock; what a run folder may hold; what a save or a rollback must never delete. The refusals a
user can meet in one process are in the catalog (tests/test_bad_inputs.py)."""

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, read_metrics, run_train

from configs import UserError, config_to_toml, load_config
from training import run_folder

DEBUG = ["--config", str(REPO / "configs" / "llama3_debug.toml"), "--training.steps", "2"]
CHECKPOINT_EXAMPLE = ["--checkpoint.enable", "--checkpoint.interval", "10"]  # README, Checkpoints


def files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under folder: its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stdout[-2000:] + result.stderr[-2000:]
    return lines[0]


@pytest.mark.slow  # six runs of the debug model
def test_readme_commands_run_twice_then_extended_and_cut(tmp_path):
    """The README's first command twice starts over, its records kept in previous-1/; the
    checkpoint example saves, then has nothing to do; more steps continue (the lr change said);
    fewer are refused."""
    folder = tmp_path / "llama3_debug"
    train = lambda *extra, check=True: run_train(
        [*DEBUG, "--job.dump_folder", str(folder), *extra], check=check
    )
    train()
    first = (folder / "metrics.jsonl").read_text()
    result = train()
    moved = "the records of an earlier run with no checkpoint to continue (metrics.jsonl, tb, config.toml)"
    assert f"{moved} moved to {folder / 'previous-1'}: this run's start anew" in result.stdout
    assert (folder / "previous-1" / "metrics.jsonl").read_text() == first
    assert [r["step"] for r in read_metrics(folder)] == [2]

    train(*CHECKPOINT_EXAMPLE)  # no checkpoint yet: starts over too
    assert (folder / "previous-2" / "metrics.jsonl").is_file() and (folder / "checkpoint" / "step-2").is_dir()
    before = files(folder)
    result = train(*CHECKPOINT_EXAMPLE)
    nothing = "nothing to do: step 2 is the last (training.steps); raise training.steps to train further"
    assert nothing in result.stdout
    assert "model llama3" not in result.stdout and files(folder) == before  # nothing built, nothing touched

    result = train(*CHECKPOINT_EXAMPLE, "--training.steps", "4")
    assert f"resumed from {folder / 'checkpoint' / 'step-2'} " in result.stdout
    changes = "the learning rate changes mid-run (training.steps 2 -> 4): step 3 would have had lr 0.003"
    assert result.stdout.count(changes) == 1 and f"{changes}, it gets 0.0018 (" in result.stdout
    assert [r["step"] for r in read_metrics(folder)] == [2, 4]

    before = files(folder)
    result = train(*CHECKPOINT_EXAMPLE, "--training.steps", "3", check=False)
    assert error_line(result) == (
        f"error: training.steps 3 is below the step of the checkpoint this run continues, "
        f"{folder / 'checkpoint' / 'step-4'}: raise training.steps to 4 or more, or go back to an earlier "
        "checkpoint: --checkpoint.load_step 2"
    )
    assert files(folder) == before


def test_records_are_continued_only_by_a_resume_of_the_run_that_saved(tmp_path):
    """A resume continues the records; a run that does not resume sets them aside, as does a resume
    after a run without checkpointing wrote records here (they are not the checkpoint's run's)."""
    config = load_config([*TINY, "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
    without_checkpoints = load_config([*TINY, "--job.dump_folder", str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.toml").write_text(config_to_toml(config))
    run_folder._start_records(tmp_path, config, resumed=True, step=1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not list(tmp_path.glob("previous-*"))
    run_folder._start_records(tmp_path, without_checkpoints, resumed=False, step=0)
    assert (tmp_path / "previous-1" / "metrics.jsonl").is_file() and not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    run_folder._start_records(tmp_path, config, resumed=True, step=5)
    assert (tmp_path / "previous-2" / "metrics.jsonl").is_file() and not (tmp_path / "metrics.jsonl").exists()
    assert load_config(["--config", str(tmp_path / "config.toml")]) == config


HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from training.run_folder import lock
lock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


def test_the_lock_names_its_holder_and_ends_with_it_even_by_kill_9(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        holder_named = rf"\(pid {holder.pid} on {socket.gethostname()}, started "
        expected = rf"'{tmp_path}' is in use by another run {holder_named}"
        with pytest.raises(UserError, match=expected):
            run_folder.lock(tmp_path)
    finally:
        holder.kill()  # SIGKILL: nothing of it runs
        holder.wait()
    try:
        run_folder.lock(tmp_path)  # the kernel dropped the lock with its process
    finally:
        run_folder.release()


@pytest.mark.slow
def test_every_rank_stops_when_the_folder_is_locked(tmp_path):
    """Rank 0 finds the lock; rank 1 stops too, with the same exit code, before building anything
    (torchrun looks at its workers every 5 s here, so it stops no worker itself)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--monitor-interval", "5"]  # fmt: skip
    run_folder.lock(tmp_path)
    try:
        command = [*torchrun, str(REPO / "train.py"), *TINY, "--job.dump_folder", str(tmp_path)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        run_folder.release()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is in use by another run" in errors[0], result.stderr[-3000:]
    assert result.stderr.count("exitcode  : 2") == 2, result.stderr[-3000:]  # both ranks


def test_fault_tolerance_groups_lock_their_records_and_group_0_the_dump_folder(tmp_path):
    groups = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    folder = ["--job.dump_folder", str(tmp_path)]
    group = lambda i: load_config([*TINY, *groups, "--fault_tolerance.replica_id", str(i), *folder])
    try:
        assert run_folder._claim(group(1)).record_folder == tmp_path / "replica_1"
        run_folder._claim(group(0))  # the dump folder is free for group 0, its own record folder too
        with pytest.raises(UserError, match="replica_1' is in use by another run"):
            run_folder._claim(group(1))
        with pytest.raises(UserError, match=f"'{tmp_path}' is in use by another run"):
            run_folder.lock(tmp_path)  # a plain run in the groups' folder
    finally:
        run_folder.release()


def test_folders_written_by_runs_are_run_folders(tmp_path):
    for folder in ("checkpoint/step-5", "tb", "profiles", "previous-1", "replica_0", "ckpt/step-2.partial"):
        (tmp_path / folder).mkdir(parents=True)
    for name in ("config.toml", "metrics.jsonl", "metrics.jsonl.tmp", "replica_0.log", "lighthouse.log",
                 "train.log", ".run.lock", "run_id"):  # fmt: skip
        (tmp_path / name).write_text("")
    run_folder.refuse_unless_run_folder(tmp_path, "checkpoint")  # (ckpt/: an earlier checkpoint.folder)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(UserError, match="is not a run folder: it holds notes.txt, which no run writes"):
        run_folder.refuse_unless_run_folder(tmp_path, "checkpoint")


def test_a_save_renames_what_sits_at_its_step_aside(tmp_path):
    """A step-2 folder without .metadata (not a checkpoint: never loaded) is reported at start-up and,
    when step 2 is saved, renamed step-2.incomplete-1 with everything in it, not deleted."""
    stray = tmp_path / "checkpoint" / "step-2"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("mine")
    saving = ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "2"]
    result = run_train([*TINY, *saving, "--job.dump_folder", str(tmp_path)])
    assert f"ignoring {stray}: not a complete checkpoint (no .metadata)" in result.stdout
    renamed = f"{stray} was already there (not a complete checkpoint): renamed step-2.incomplete-1"
    assert renamed in result.stdout
    assert (tmp_path / "checkpoint" / "step-2.incomplete-1" / "notes.txt").read_text() == "mine"
    assert (stray / ".metadata").is_file()


@pytest.fixture
def process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_rollback_that_cannot_set_a_later_checkpoint_aside_stops(process_group, tmp_path, monkeypatch):
    """Were step-10 left in place, the next plain rerun would resume it instead of this run."""
    from checkpoint.loading import set_aside_later

    for step in (5, 10):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").write_text("")

    def refused(path, target):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(Path, "rename", refused)
    expected = r"checkpoint.load_step 5: the later checkpoint .*step-10 could not be set aside \(Permission"
    with pytest.raises(UserError, match=expected):
        set_aside_later(tmp_path, 5)
