"""Checkpointing: exact resume, resharding across layouts, atomic saves, preemption, bad checkpoints.

All through real `train.py` runs (fp32, CPU). The reference is one uninterrupted single-process
run of 10 steps that also saves at step 5. The runs read a shuffled mixture of three token-shard
sources, one of them in its third epoch by the end: the data order is part of what must resume.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    TINY,
    children,
    descendants,
    fake_slurm,
    free_port,
    read_metrics,
    run_train,
    start_train,
    write_mixture,
)

STEPS = 10
# 80 samples of 32 tokens over 10 steps, weights 5:3:2: 'small' (6 samples) is in its third epoch.
SOURCES = write_mixture(
    Path(tempfile.mkdtemp(prefix="checkpoint-data-")), {"web": 3201, "code": 1281, "small": 193}
)
MIXTURE = ["--training.dataset", "tokens", "--training.dataset_path", ",".join(map(str, SOURCES)),
           "--training.dataset_weights", "5,3,2"]  # fmt: skip
# Global batch 8, checkpoints every 5 steps, sample ids recorded.
COMMON = [*TINY, *MIXTURE, "--training.steps", str(STEPS), "--training.global_batch_size", "8",
          "--checkpoint.enable", "--checkpoint.interval", "5", "--metrics.log_sample_ids"]  # fmt: skip
SINGLE = ["--training.local_batch_size", "8"]


def by_step(records: list[dict]) -> dict[int, dict]:
    """The last record of each step (a killed run may have logged steps that were redone)."""
    return {r["step"]: r for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("reference")
    run_train([*COMMON, *SINGLE, "--job.dump_folder", str(folder)])
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Runs on other layouts, each leaving a checkpoint at step 5, made on first use."""
    layouts = {
        "fsdp2": (2, ["--training.local_batch_size", "4"]),
        "pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    }  # fmt: skip
    made = {}

    class Sources(dict):
        def __missing__(self, name):
            nproc, overrides = layouts[name]
            folder = tmp_path_factory.mktemp(name)
            run_train([*COMMON, *overrides, "--job.dump_folder", str(folder)], nproc=nproc)
            made[name] = folder
            return folder

    return Sources()


def resume_from(source: Path, tmp_path: Path, step: int = 5) -> Path:
    """A new run folder holding only the source's step checkpoint."""
    target = tmp_path / "resumed"
    shutil.copytree(source / "checkpoint" / f"step-{step}", target / "checkpoint" / f"step-{step}")
    return target


def assert_continues(resumed: Path, reference: Path, rel: float) -> None:
    got, want = by_step(read_metrics(resumed)), by_step(read_metrics(reference))
    assert sorted(got) == list(range(6, STEPS + 1))  # it started after the checkpoint
    for step, record in got.items():
        assert record["loss"] == pytest.approx(want[step]["loss"], rel=rel, abs=0), step
        # The global order continues on any number of data-parallel ranks: step s reads samples
        # [(s - 1) x 8, s x 8) wherever they are, each source's next ones.
        assert record["sample_ids"] == want[step]["sample_ids"] == list(range((step - 1) * 8, step * 8)), step
        assert record["source_samples"] == want[step]["source_samples"], step
        assert record["source_epochs"] == want[step]["source_epochs"], step
    assert got[STEPS]["source_samples"] == {"web": 40, "code": 24, "small": 16}
    assert got[STEPS]["source_epochs"]["small"] >= 3  # (4 with multi-token prediction's longer samples)


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, nproc, overrides",
    [
        ("fsdp2", 4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
        ("pp2", 4, ["--training.local_batch_size", "2"]),  # PP 2 (two stages per rank) -> FSDP 4
        (
            "single",
            4,
            ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"],
        ),
        ("single", 2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
        ("fsdp2", None, ["--training.local_batch_size", "8"]),
    ],
    ids=["fsdp2-to-fsdp2xtp2", "pp2-to-fsdp4", "single-to-hsdp2x2", "single-to-cp2", "fsdp2-to-single"],
)
def test_resume_on_another_layout(source, nproc, overrides, reference, sources, tmp_path):
    folder = resume_from(reference if source == "single" else sources[source], tmp_path)
    result = run_train([*COMMON, *overrides, "--job.dump_folder", str(folder)], nproc=nproc)
    # The resume's log line names where its time went.
    parts = r"state prepared in \S+ s, files read in \S+ s \(byte records \S+ s, tensors \S+ s\), checked"
    assert re.search(r"resumed from .*" + parts, result.stdout), result.stdout
    assert f"training steps 6 to {STEPS}" in result.stdout and "step 6 done" in result.stdout
    assert_continues(folder, reference, rel=1e-5)


def logged_steps(folder: Path) -> list[int]:
    """Steps in metrics.jsonl so far (a run being written or killed may leave half a last line)."""
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


@pytest.mark.slow
def test_kill_9_and_rerun_resumes_bitwise_and_logs_each_step_once(tmp_path):
    """kill -9 a 2-rank run saving in the background every 10 steps, after it logged steps past
    its first checkpoint (maybe during a save); the same command finishes it from the latest
    complete checkpoint, and metrics.jsonl drops the steps it redoes."""
    steps = ["--training.steps", "30", "--checkpoint.interval", "10", "--checkpoint.async_mode", "async"]
    args = [*COMMON, *steps, "--training.local_batch_size", "4"]
    uninterrupted = tmp_path / "uninterrupted"
    off = ["--checkpoint.enable", "false", "--job.dump_folder", str(uninterrupted)]
    result = run_train([*args, *off], nproc=2)
    warning = "checkpoint.interval, checkpoint.async_mode set, but checkpoint.enable is false: no checkpoint"
    assert warning in result.stdout
    folder = tmp_path / "killed"
    process = start_train([*args, "--job.dump_folder", str(folder)], nproc=2, log=tmp_path / "killed.log")
    deadline = time.time() + 120
    past_a_checkpoint = lambda steps: (folder / "checkpoint" / "step-10").exists() and steps[-1] % 10 != 0
    while (
        not past_a_checkpoint(logged_steps(folder) or [0])
        and process.poll() is None
        and time.time() < deadline
    ):
        time.sleep(0.02)
    for pid in [process.pid, *descendants(process.pid)]:  # torchrun and its workers at once
        os.kill(pid, signal.SIGKILL)
    process.wait()
    killed_at = max(logged_steps(folder))
    assert (folder / "checkpoint" / "step-10").exists() and killed_at < 30, "killed too late"
    result = run_train([*args, "--job.dump_folder", str(folder)], nproc=2)
    resumed = int(re.search(r"resumed from \S+step-(\d+) ", result.stdout).group(1))
    assert resumed < killed_at  # steps resumed + 1 .. killed_at were logged twice
    assert f"metrics.jsonl continues after step {resumed} (" in result.stdout
    want = by_step(read_metrics(uninterrupted))
    records = read_metrics(folder)
    assert [r["step"] for r in records] == list(range(1, 31))  # one record per step, in order
    assert [r["loss"] for r in records] == [want[s]["loss"] for s in range(1, 31)]  # bitwise


def tensorboard_losses(folder: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars("loss")]


def test_resume_drops_the_metrics_and_tensorboard_events_of_redone_steps(tmp_path):
    """Steps 1-23 logged (validation at 10 and 20, half a line at the end), resumed from step 20:
    21-23 are dropped from metrics.jsonl and hidden in TensorBoard; validation records stay."""
    from training.metrics import MetricsLogger

    def logger(resumed_step: int) -> MetricsLogger:
        return MetricsLogger(str(tmp_path), torch.device("cpu"), 64, 1, 1.0, 30, None, 1, write=True,
                             enable_tensorboard=True, resumed_step=resumed_step)  # fmt: skip

    first = logger(0)
    for step in range(1, 24):
        first.log(step, float(step), 1.0, 1e-3)
        if step % 10 == 0:
            first.log_validation(step, {"val_loss": 0.5, "val_perplexity": 1.6})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 24, "lo')  # killed while writing
    second = logger(20)
    second.tensorboard.flush()
    assert tensorboard_losses(tmp_path) == [(s, float(s)) for s in range(1, 21)]  # before any new log
    for step in range(21, 26):
        second.log(step, 100.0 + step, 1.0, 1e-3)
    second.close()
    records = read_metrics(tmp_path)
    training = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert training == [(s, float(s)) for s in range(1, 21)] + [(s, 100.0 + s) for s in range(21, 26)]
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20]
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)  # each after its step's
    assert tensorboard_losses(tmp_path) == training


def test_changed_global_batch_warns_and_continues_from_the_next_sample(reference, tmp_path):
    folder = resume_from(reference, tmp_path)
    bigger = ["--training.local_batch_size", "16", "--training.global_batch_size", "16"]
    result = run_train([*COMMON, *bigger, "--job.dump_folder", str(folder)])
    assert "training.global_batch_size changed from 8 to 16" in result.stdout + result.stderr
    first = by_step(read_metrics(folder))[6]
    assert first["sample_ids"] == list(range(40, 56))
    # The new folder adopted the copied checkpoint's run (checkpoint/run_identity.py), and saves as it.
    run_id = (reference / "run_id").read_text().strip()
    assert (folder / "run_id").read_text().strip() == run_id
    for step in (5, 10):
        manifest = folder / "checkpoint" / f"step-{step}" / "checksums.json"
        assert json.loads(manifest.read_text())["run_id"] == run_id


def test_run_identity_is_made_adopted_and_checked(tmp_path, caplog):
    """checkpoint/run_identity.py: a folder's identity is made once, never replaced; a folder without
    one adopts the checkpoint's; another run's checkpoint is refused unless allowed; one saved
    before identities is loaded with a note."""
    from checkpoint import run_identity
    from configs import UserError

    theirs, checkpoint = {"run_id": "0123456789abcdef", "files": {}}, tmp_path / "checkpoint" / "step-5"
    assert run_identity.check(checkpoint, theirs, tmp_path, False) == "0123456789abcdef"  # nothing yet
    run_identity.adopt(tmp_path, "0123456789abcdef")
    assert run_identity.for_saves(tmp_path) == "0123456789abcdef"
    run_identity.adopt(tmp_path, "fedcba9876543210")  # (made once: never replaced)
    assert run_identity.of_folder(tmp_path) == "0123456789abcdef"
    other = {"run_id": "fedcba9876543210", "files": {}}
    with pytest.raises(UserError, match=r"another run \(run fedcba9876543210; this folder's run is 0123"):
        run_identity.check(checkpoint, other, tmp_path, allow_other_run=False)
    with caplog.at_level(logging.INFO, logger="checkpoint"):
        assert run_identity.check(checkpoint, other, tmp_path, True) is None  # (nothing adopted)
        assert run_identity.check(checkpoint, {"files": {}}, tmp_path, False) is None
    said = [record.getMessage() for record in caplog.records]
    assert said[0].endswith("resumed as checkpoint.allow_other_run asks; this run's saves stay its own")
    assert said[1] == f"{checkpoint} was saved before checkpoints recorded their run: loaded as this run's"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert re.fullmatch(r"[0-9a-f]{16}", made := run_identity.for_saves(fresh))
    assert run_identity.for_saves(fresh) == made


def test_incomplete_save_is_ignored_and_an_unverifiable_checkpoint_loads(reference, tmp_path):
    folder = resume_from(reference, tmp_path)
    partial = folder / "checkpoint" / "step-7.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a checkpoint")
    (folder / "checkpoint" / "step-5" / "checksums.json").unlink()  # as code before checksums saved it
    result = run_train([*COMMON, *SINGLE, "--job.dump_folder", str(folder)])
    assert "resumed from" in result.stdout and "step-5" in result.stdout
    assert "ignoring" in result.stdout and "step-7.partial" in result.stdout
    assert "step-5 has no checksums.json (saved by an older version)" in result.stdout
    assert_continues(folder, reference, rel=0)  # same layout: bitwise


def checksums(folder: Path) -> dict[str, str]:
    """Data files of a checkpoint (not .metadata) by content."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.distcp"))}


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["process", "thread"])
def test_async_save_writes_the_same_bytes_as_sync(writer, reference, tmp_path):
    """The reference saves with O_DIRECT (checkpoint.direct_io, default), this run through the page
    cache. async_with_pinned_mem takes this path too without a GPU (pinned buffers and side-stream
    copies need CUDA: checkpoint/fast_io/staging.py); on the H200 it is measured (docs/performance.md)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = tmp_path / "async"
    # ... and through the page cache (direct_io off): still the same bytes and checksums.
    async_mode = ["--checkpoint.async_mode", "async", "--checkpoint.direct_io", "false"]
    result = run_train([*COMMON, *SINGLE, *async_mode, "--checkpoint.async_writer", writer,
                        "--job.dump_folder", str(folder)])  # fmt: skip
    # Written by the writer process (checkpoint/fast_io/writer_process.py, from the host buffers it
    # shares) or by a thread of the training process.
    assert f"{folder / 'checkpoint' / 'step-5'} in the background by the writer {writer}" in result.stdout
    for step in (5, 10):
        sync, asynchronous = reference / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}"
        data = checksums(asynchronous)
        assert data == checksums(sync) and any(name.endswith(".distcp") for name in data)
        # .metadata also records the path and a save id; what it says of the data must agree.
        index = [FileSystemReader(str(f)).read_metadata().state_dict_metadata for f in (sync, asynchronous)]
        assert index[0] == index[1]
        # The checksums of the data files, taken in the background, are those of the blocking save.
        recorded = [json.loads((f / "checksums.json").read_text())["files"] for f in (sync, asynchronous)]
        assert {k: v for k, v in recorded[1].items() if k != ".metadata"} == {
            k: v for k, v in recorded[0].items() if k != ".metadata"
        }
        assert set(recorded[1]) == {".metadata", *data}


def test_writer_process_rebuilds_the_staged_state_as_dcp_plans_it():
    """checkpoint/fast_io/writer_process.py: what the writer rebuilds from the shared buffers (and, for a
    tensor made after them, from the request) is the staged state, and DCP plans and resolves it as
    it does the staged state itself, DTensor shards included (here rank 2 of a 4-rank mesh)."""
    import pickle

    import torch.distributed as dist
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from checkpoint.fast_io.staging import Stager
    from checkpoint.fast_io.writer_process import ByValue, InArena, _rebuild, describe_staged

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        state = {
            "model": {
                "w": DTensor.from_local(torch.randn(3, 5), mesh, [Shard(0)]),  # rows 6-8 of 12
                "norm": DTensor.from_local(torch.randn(4), mesh, [Replicate()]),
            },
            "optimizer": {"step": torch.tensor(7.0), "lr": 0.1},
        }
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        stager = Stager(True, True, [optimizer], lambda: state)
        optimizer.step()  # the buffers are made after the first step
        state["optimizer"]["late"] = torch.ones(2)  # a tensor the buffers do not hold
        staged = stager.stage(state)
        described = describe_staged(stager, staged)
        assert isinstance(described["model"]["w"], InArena) and described["model"]["w"].shard_offsets == (
            6,
            0,
        )
        assert isinstance(described["optimizer"]["late"], ByValue)
        rebuilt = _rebuild(stager.arena.bytes, pickle.loads(pickle.dumps(described)))
        plans = []
        for candidate in (staged, rebuilt):
            planner = DefaultSavePlanner()
            planner.set_up_planner(candidate, is_coordinator=True)
            items = sorted(planner.create_local_plan().items, key=lambda item: item.index.fqn)
            data = [planner.resolve_data(item) for item in items]
            plans.append((items, [d if isinstance(d, torch.Tensor) else d.getvalue() for d in data]))
        assert plans[0][0] == plans[1][0]
        for ours, theirs in zip(plans[0][1], plans[1][1]):
            assert torch.equal(ours, theirs) if isinstance(ours, torch.Tensor) else ours == theirs
    finally:
        dist.destroy_process_group()


def _async_checkpointer(folder: Path, writer: str = "process", stop_requested=lambda: None):
    """(model, optimizer, Checkpointer) of a tiny Linear model, saving async through writer
    processes (or threads), the process group already made; one optimizer step taken (the host
    buffers are made after the first step)."""
    from checkpoint.manager import Checkpointer
    from checkpoint.state import TrainState
    from configs.schema import Checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizers = type("Optimizers", (), {"parts": [optimizer]})()
    dataloader = type("Loader", (), {"state_dict": lambda self: {"position": 3}})()
    config = Checkpoint(enable=True, async_mode="async", async_writer=writer)
    checkpointer = Checkpointer(config, folder, [model], optimizers, dataloader, TrainState(), None, 10,
                                stop_requested=stop_requested)  # fmt: skip
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, checkpointer


def test_async_save_is_committed_when_its_write_ends(tmp_path):
    """An async save is committed (checksums written, renamed step-N) by its background writer as
    soon as the write ends: with nothing else called on the checkpointer (no later save, no end of
    training), step-1 appears complete. (Committed at the next save, a kill before it lost up to
    two intervals.) The save returned before the writer process had started. A later save with a
    tensor made after the buffers completes too."""
    import torch.distributed as dist

    from checkpoint.saving import complete_steps

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, optimizer, checkpointer = _async_checkpointer(tmp_path)
        checkpointer.save(1)
        assert checkpointer.storage.writer.ready is False  # the save did not wait for the writer to start
        deadline = time.monotonic() + 60
        while complete_steps(tmp_path / "checkpoint") != [1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert complete_steps(tmp_path / "checkpoint") == [1]
        assert (tmp_path / "checkpoint" / "step-1" / "checksums.json").exists()
        # A tensor the shared buffers do not hold goes to the writer by value (plain pickle: the
        # connection's own pickler would pass its storage as a descriptor the writer refuses).
        model.register_buffer("late", torch.arange(3.0))
        checkpointer.save(2)
        checkpointer.wait()
        assert complete_steps(tmp_path / "checkpoint") == [1, 2]
        checkpointer.close()
    finally:
        dist.destroy_process_group()


def test_a_writer_process_that_died_between_saves_is_replaced_by_a_thread(tmp_path, caplog):
    """The writer process killed (kill -9, the OOM killer) after a save: the next save is written
    by a thread of the training process, said in one warning, and committed (the run used to stop
    there, though training was healthy); the saves after it too."""
    import torch.distributed as dist

    from checkpoint.saving import complete_steps

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _, _, checkpointer = _async_checkpointer(tmp_path)
        checkpointer.save(1)
        checkpointer.wait()
        checkpointer.storage.writer.process.kill()
        checkpointer.storage.writer.process.wait()
        with caplog.at_level(logging.WARNING, logger="checkpoint"):
            checkpointer.save(2)
            checkpointer.wait()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
            "the checkpoint writer process ended (killed by SIGKILL: out of memory, or kill -9): this save "
            "and the next are written by a thread of the training process instead (training may run slower "
            "while one writes: docs/checkpointing.md)"
        ]
        checkpointer.save(3)
        checkpointer.close()
        assert complete_steps(tmp_path / "checkpoint") == [1, 2, 3]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_stopped_writer_is_given_up_with_one_error_and_the_last_checkpoint_kept(
    writer, tmp_path, monkeypatch, caplog
):
    """The writer process stopped (SIGSTOP) while it writes step 2, or a writer thread stuck in
    its write: the save of step 3 waits for it, saying so, then gives up (process: past the bound,
    here 1 s + the size at 50 MB/s; thread: a stop signal comes while it waits) with one error,
    step-1 intact, the writer process killed, no step-2 ever committed. (It used to wait forever,
    silently, deaf to SIGTERM; a watchdog here lets the old wait end after 60 s.)"""
    import torch.distributed as dist

    from checkpoint import background
    from checkpoint.saving import complete_steps
    from configs import UserError

    monkeypatch.setattr(background, "LOG_EVERY_S", 0.3)
    signal_received = []
    stuck = threading.Event()
    if writer == "thread":  # the write of step 2 blocks until released
        import checkpoint.fast_io as fast_io

        write_files = fast_io.write_files

        def stuck_at_step_2(state, folder, *args, **kwargs):
            if folder.name == "step-2.partial":
                stuck.wait()
            return write_files(state, folder, *args, **kwargs)

        monkeypatch.setattr(fast_io, "write_files", stuck_at_step_2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _, _, checkpointer = _async_checkpointer(tmp_path, writer, lambda: next(iter(signal_received), None))
        checkpointer.save(1)
        checkpointer.wait()  # (the writer process has started: 120 s bound that)
        monkeypatch.setattr(background, "BASE_S", 1.0)
        if writer == "process":
            process = checkpointer.storage.writer.process
            os.kill(process.pid, signal.SIGSTOP)
            watchdog = threading.Timer(60, os.kill, (process.pid, signal.SIGCONT))
        else:
            threading.Timer(0.8, signal_received.append, ("SIGTERM",)).start()
            watchdog = threading.Timer(60, stuck.set)
        watchdog.start()
        checkpointer.save(2)
        with caplog.at_level(logging.INFO, logger="checkpoint"), pytest.raises(UserError) as given_up:
            checkpointer.save(3)
        watchdog.cancel()
        folder = tmp_path / "checkpoint"
        why = (
            r"its background write had not finished \d+ s after it began \(the bound: 1 s \+ 0\.0 GB at 50 "
            r"MB/s, checkpoint\.async_min_write_mb_per_s; a writer stopped or stuck\?\)"
            if writer == "process"
            else r"stopped by SIGTERM while waiting \d+ s for its background write"
        )
        assert re.fullmatch(
            f"checkpoint {folder / 'step-2'} could not be saved: {why}; {folder / 'step-1'} is the latest "
            "complete one",
            str(given_up.value),
        ), given_up.value
        said = [record.getMessage() for record in caplog.records]
        assert any(line.startswith("waiting for the background save of step 2 (") for line in said), said
        if writer == "process":
            assert process.poll() is not None  # killed, not left stopped
        stuck.set()  # (the stuck thread writes after all: nothing of it is committed)
        for thread in threading.enumerate():
            if thread.name == "checkpoint-2":
                thread.join(timeout=30)
        assert complete_steps(folder) == [1] and not (folder / "step-2.partial").exists()
        checkpointer.storage.close()
    finally:
        dist.destroy_process_group()


def _save_with_shared_memory_refused_on_rank_1(rank: int, folder: str, port: int) -> None:
    """One rank of test_writers_agree_when_one_rank_has_no_shared_memory (a spawned process)."""
    import errno

    import torch.distributed as dist

    from checkpoint.fast_io import staging
    from checkpoint.saving import complete_steps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # the writers meet there too
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:

        def refused(*args, **kwargs):
            raise OSError(errno.ENOMEM, "shared memory refused (test)")

        staging.HostArena = refused
    model, optimizer, checkpointer = _async_checkpointer(Path(folder))
    assert checkpointer.storage.writer is None, f"rank {rank} kept its writer process"
    checkpointer.save(1)
    checkpointer.wait()
    assert complete_steps(Path(folder) / "checkpoint") == [1]
    checkpointer.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_writers_agree_when_one_rank_has_no_shared_memory(tmp_path):
    """If one rank gets no shared memory for its host buffers (it writes from a thread), every rank
    writes from a thread: a writer process saving alongside would wait for that rank's writer."""
    import multiprocessing

    port = free_port()
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_save_with_shared_memory_refused_on_rank_1, args=(rank, str(tmp_path), port))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + 120
    for process in ranks:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    assert [process.exitcode for process in ranks] == [0, 0]


@pytest.mark.parametrize("direct", [True, False])
def test_data_file_writes_an_ordinary_files_bytes_and_checksums(direct, monkeypatch, tmp_path):
    """checkpoint/fast_io/data_files.py: bytes written in pieces (the last one padded for O_DIRECT, then
    truncated) read back as written, and the CRC32s taken on the way are those integrity.checksum
    reads back; empty files too."""
    import random

    from checkpoint import integrity
    from checkpoint.fast_io import data_files

    piece = 16 * data_files.ALIGNMENT
    monkeypatch.setattr(data_files, "PIECE_BYTES", piece)
    rng = random.Random(0)
    sizes_of = {"a.distcp": [1, piece - 1, 3 * piece + 5, 17, piece, *[700] * 200], "empty.distcp": []}
    for name, sizes in sizes_of.items():  # (the 700-byte writes: the small-write path across pieces)
        chunks = [rng.randbytes(n) for n in sizes]
        with data_files.DataFile(tmp_path / name, direct) as stream:
            for chunk in chunks:
                stream.write(memoryview(chunk))
            assert stream.tell() == sum(sizes)
        assert (tmp_path / name).read_bytes() == b"".join(chunks)
        assert stream.summary() == integrity.checksum([tmp_path / name], piece)[name]


def test_data_file_names_its_file_in_a_write_error_and_falls_back_from_o_direct(monkeypatch, tmp_path):
    """A failed write (here ENOSPC) is an OSError naming the file (the save's error line shows it); a
    filesystem refusing an O_DIRECT write (EINVAL) gets ordinary writes of the same bytes."""
    import errno

    from checkpoint.fast_io import data_files

    write = data_files.os.write
    refusals = []

    def refusing(fd, data):
        if refusals:
            raise OSError(refusals.pop(), "refused")
        return write(fd, data)

    monkeypatch.setattr(data_files.os, "write", refusing)
    data = os.urandom(data_files.PIECE_BYTES + 10)
    with data_files.DataFile(tmp_path / "fallback.distcp", direct=True) as stream:
        stream.direct = True  # (as if the filesystem took O_DIRECT at open)
        refusals.append(errno.EINVAL)
        stream.write(data)
    assert (tmp_path / "fallback.distcp").read_bytes() == data and not stream.direct and not refusals
    refusals.append(errno.ENOSPC)
    with pytest.raises(OSError) as failed:
        with data_files.DataFile(tmp_path / "full.distcp", direct=True) as stream:
            stream.write(data)
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "full.distcp")


def test_parallel_reader_reads_one_file_in_runs_and_equals_dcps_reader(monkeypatch, tmp_path):
    """checkpoint/fast_io/data_files.ParallelReader: a checkpoint in one file (as the conversion scripts
    write) is read by several threads, each a run of its records of about equal bytes; the state
    loaded is the one saved (the resume tests load every layout through it)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from checkpoint.fast_io.data_files import ParallelReader, equal_runs

    assert equal_runs(list("abcdef"), [1, 1, 1, 1, 1, 10], 3) == [list("abcde"), ["f"]]
    assert equal_runs(list("ab"), [5, 5], 8) == [["a"], ["b"]] and equal_runs([], [], 4) == []
    saved = {f"w{i}": torch.randn(32, 8) for i in range(8)} | {"step": 7}
    warnings.filterwarnings("ignore")  # DCP without a process group says so
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path), thread_count=1))
    assert len(list(tmp_path.glob("*.distcp"))) == 1
    runs, read = [], FileSystemReader.read_data
    monkeypatch.setattr(FileSystemReader, "read_data", lambda self, plan, planner: (
        runs.append(len(plan.items)), read(self, plan, planner))[1])  # fmt: skip
    loaded = {name: torch.zeros(32, 8) for name in saved if name != "step"} | {"step": 0}
    dcp.load(loaded, storage_reader=ParallelReader(tmp_path, 4))
    assert runs == [1, 2, 2, 2, 2]  # the byte record, then four runs of two tensors
    assert loaded["step"] == 7 and all(torch.equal(loaded[n], saved[n]) for n in saved if n != "step")


def test_save_planner_serializes_each_plain_value_once_and_writes_dcps_bytes(tmp_path):
    """checkpoint/fast_io/writing.SaveOnceEachValue: the files are byte for byte those of DCP's own
    planner, while equal plain values (the optimizer's per-parameter hyperparameters) are
    serialized once; values that look equal but save differently (0.0 / -0.0, 1 / True) stay apart."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from checkpoint.fast_io.data_files import storage_writer
    from checkpoint.fast_io.writing import SaveOnceEachValue
    from checkpoint.state import optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {
        "optimizer": optimizer_state([model], [optimizer]),
        "odd": [0.0, -0.0, 1, True, (0.9, 0.95), None],
    }
    state["odd"] = {str(i): value for i, value in enumerate(state["odd"])}
    warnings.filterwarnings("ignore")  # DCP without a process group says so
    planner = SaveOnceEachValue()
    for folder, chosen in [("ours", planner), ("dcp", DefaultSavePlanner())]:
        dcp.save(state, storage_writer=storage_writer(tmp_path / folder, 1, False), planner=chosen)
    for ours in sorted((tmp_path / "ours").glob("*.distcp")):
        assert ours.read_bytes() == (tmp_path / "dcp" / ours.name).read_bytes()
    byte_records = sum(not isinstance(v, torch.Tensor) for v in state["optimizer"].values()) + 6
    # 4 parameters x 12 hyperparameters: serialized once per distinct value, the odd ones apart
    assert len(planner.serialized) < byte_records / 3
    assert {("float", "0.0"), ("float", "-0.0"), ("int", "1"), ("bool", "True")} <= set(planner.serialized)


def test_keep_latest_k_deletes_only_complete_old_checkpoints(tmp_path):
    folder = tmp_path / "keep"
    stray = folder / "checkpoint" / "step-3.partial"
    stray.mkdir(parents=True)
    run_train([*COMMON, *SINGLE, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2",
               "--job.dump_folder", str(folder)])  # fmt: skip
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == [
        "step-10",
        "step-3.partial",
        "step-8",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, exit_code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "Ctrl-C"]
)
def test_stop_signal_saves_and_exits_cleanly(sig, exit_code, tmp_path):
    folder = tmp_path / "preempted"
    log = tmp_path / "run.log"
    process = start_train([*COMMON, *SINGLE, "--training.steps", "100000", "--checkpoint.interval", "100000",
                           "--job.dump_folder", str(folder)], log=log)  # fmt: skip
    deadline = time.time() + 120
    while not (folder / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(sig)
    assert process.wait(timeout=120) == exit_code
    output = log.read_text()
    assert "Traceback" not in output
    saved = [line for line in output.splitlines() if f"stopped by {sig.name} after step" in line]
    assert len(saved) == 1, output[-2000:]
    step = max(r["step"] for r in read_metrics(folder))
    assert saved[0].endswith(f"saved {folder / 'checkpoint' / f'step-{step}'}")
    assert (folder / "checkpoint" / f"step-{step}" / ".metadata").exists()


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    return lines[0]


@pytest.mark.slow
def test_damaged_checkpoint_is_refused_by_every_rank_and_kept(sources, tmp_path):
    """4 KiB flipped in rank 1's file (same size): rank 1 finds it, both ranks stop before loading."""
    folder = resume_from(sources["fsdp2"], tmp_path)
    data = folder / "checkpoint" / "step-5" / "__1_0.distcp"
    content = bytearray(data.read_bytes())
    content[4096:8192] = bytes(byte ^ 0xFF for byte in content[4096:8192])
    data.write_bytes(bytes(content))
    before = checksums(folder / "checkpoint" / "step-5")
    result = run_train([*COMMON, "--training.local_batch_size", "4", "--job.dump_folder", str(folder)],
                       nproc=2, check=False)  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stdout[-2000:] + result.stderr[-2000:]
    damaged = folder / "checkpoint" / "step-5"
    assert f"checkpoint {damaged} is damaged: __1_0.distcp does not match its checksum" in errors[0]
    assert checksums(damaged) == before
    assert not (folder / "metrics.jsonl").exists() and "resumed from" not in result.stdout


def test_a_full_disk_is_named_in_the_save_error(monkeypatch, tmp_path):
    """torch's writers report a full disk in words that do not say so ("unexpected pos 704 vs
    598", seen on the H200 machine): the error line adds the free space when it is nearly gone."""
    from types import SimpleNamespace

    from checkpoint import storage

    assert storage.low_disk_note(tmp_path) == ""  # this disk has room
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: SimpleNamespace(free=12_000_000))
    assert storage.low_disk_note(tmp_path) == " (its disk has 0.0 GB free)"


def test_writer_threads_failing_after_the_save_failed_print_nothing(monkeypatch, tmp_path):
    """A full disk fails every writer thread of DCP's (checkpoint.writer_threads); when the calling
    thread's own write fails first, DCP returns at once and the others fail later: their
    tracebacks went to stderr (threading.excepthook) before the run's error line. The save's error
    names a file."""
    import errno
    import warnings

    from checkpoint.fast_io import data_files
    from checkpoint.fast_io.writing import write_files

    calling = threading.get_ident()

    def disk_full(self):
        if threading.get_ident() != calling:
            time.sleep(0.3)  # (fail after the save has returned)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(data_files.DataFile, "_write_piece", disk_full)
    printed = []  # what would print a thread's traceback
    monkeypatch.setattr(threading, "excepthook", printed.append)
    warnings.filterwarnings("ignore")  # DCP without a process group says so
    state = {f"w{i}": torch.randn(64, 64) for i in range(8)}
    error, _ = write_files(state, tmp_path, 0, writer_threads=4, direct_io=False)
    assert re.fullmatch(rf"No space left on device \({tmp_path}/__0_\d\.distcp\)", error), error
    for thread in threading.enumerate():  # (the old code's threads, still failing)
        if "_write_files_from_queue" in thread.name:
            thread.join()
    assert printed == []


def test_a_full_disk_during_an_async_save_says_one_line(tmp_path):
    """A real full disk (a 5 MB tmpfs: step-2 fits, step-4 does not) under an async save by the
    writer process: stderr holds the run's one error line and nothing else (no traceback, no
    warning of the writer's start), naming a file; the log one warning of it."""
    folder = tmp_path / "small_disk"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(folder)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs mount here (root only): {mounted.stderr.decode().strip()}")
    try:
        args = [*TINY, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
                "--checkpoint.async_mode", "async", "--job.dump_folder", str(folder / "run")]  # fmt: skip
        result = run_train(args, check=False)
        checkpoints = folder / "run" / "checkpoint"
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert re.fullmatch(
            f"error: checkpoint {checkpoints / 'step-4'} could not be saved: No space left on device "
            rf"\({checkpoints / 'step-4.partial'}/__0_\d+\.distcp\) \(its disk has 0\.0 GB free\); "
            f"{checkpoints / 'step-2'} is the latest complete one\n",
            result.stderr,
        ), result.stderr
        assert result.stdout.count("could not be saved") == 1 and "Traceback" not in result.stdout
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
    finally:
        subprocess.run(["umount", str(folder)], check=True)


# Loaded by every train.py process through PYTHONPATH: rank 1's writes into FAIL_SAVE's folder
# fail as on a full disk, part-way through its file.
FAILING_WRITES = """
import errno, os
import torch.distributed.checkpoint.filesystem as filesystem

write_item = filesystem._write_item

def failing_write_item(transforms, stream, *args, **kwargs):
    marker = os.environ.get("FAIL_SAVE")
    if marker and os.environ.get("RANK") == "1" and marker in str(getattr(stream, "name", "")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
    return write_item(transforms, stream, *args, **kwargs)

filesystem._write_item = failing_write_item
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_failed_save_stops_every_rank_with_one_error_and_keeps_the_last(mode, tmp_path, monkeypatch):
    """Rank 1 cannot write step-10 (ENOSPC): both ranks stop with one error line naming the
    checkpoint and the cause, exit 2, no traceback; step-10's partial folder is gone, step-5 is
    complete and the same command resumes from it (async: the failure in the background stops the
    run at its next save, the last step)."""
    (tmp_path / "sitecustomize.py").write_text(FAILING_WRITES)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("FAIL_SAVE", "step-10.partial")
    folder = tmp_path / "run"
    args = [*COMMON, "--training.steps", "12", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
            "--checkpoint.async_mode", mode, "--job.dump_folder", str(folder)]  # fmt: skip
    result = run_train(args, nproc=2, check=False)
    checkpoints = folder / "checkpoint"
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(lines) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    line = lines[0]  # (the workers exit with 2; torchrun reports a failed worker with 1)
    assert line.startswith(f"error: checkpoint {checkpoints / 'step-10'} could not be saved: No space left "
                           f"on device ({checkpoints / 'step-10.partial'}/__1_"), line  # fmt: skip
    assert line.endswith(f"; {checkpoints / 'step-5'} is the latest complete one")
    # No traceback from the workers (torchrun's own report of a failed worker follows the error line).
    assert "Traceback" not in result.stderr[: result.stderr.index(line)], result.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-5"]
    assert (checkpoints / "step-5" / "checksums.json").exists()
    if mode == "async":
        monkeypatch.delenv("FAIL_SAVE")
        result = run_train(args, nproc=2)
        assert f"resumed from {checkpoints / 'step-5'} " in result.stdout


def test_checkpoint_of_another_model_is_refused(reference, tmp_path):
    folder = resume_from(reference, tmp_path)
    result = run_train([*COMMON, *SINGLE, "--model.flavor", "debugmodel", "--job.dump_folder", str(folder)],
                       check=False)  # fmt: skip
    line = error_line(result)
    assert (
        "holds a different model" in line
        and "tok_embeddings.weight is (320, 64) there, (320, 256) here" in line
    )


def test_allow_model_change_resumes_another_models_checkpoint_with_a_warning(reference, tmp_path):
    """Another rope_theta is refused (the catalog); allowed on purpose, it loads and lists what differs."""
    folder = resume_from(reference, tmp_path)
    changed = ["--model.args", "rope_theta=10000", "--checkpoint.allow_model_change"]
    result = run_train([*COMMON, *SINGLE, *changed, "--job.dump_folder", str(folder)])
    assert "holds another model (rope_theta 500000.0 there, 10000.0 here); loading it" in result.stdout
    assert "resumed from" in result.stdout
    assert sorted(by_step(read_metrics(folder))) == list(range(6, STEPS + 1))


def test_unknown_load_step_is_refused(reference, tmp_path):
    folder = resume_from(reference, tmp_path)
    result = run_train([*COMMON, *SINGLE, "--checkpoint.load_step", "7", "--job.dump_folder", str(folder)],
                       check=False)  # fmt: skip
    assert "checkpoint.load_step 7: no complete checkpoint step-7" in error_line(result)


def test_resuming_an_earlier_step_sets_the_later_checkpoints_aside(reference, tmp_path):
    """checkpoint.load_step 5 in a folder holding step-5 and step-10: step-10 (the abandoned
    future) is renamed step-10.abandoned, so keep_latest_k keeps this run's own step-8 rather than
    deleting it for the newer step-10, and the next resume continues this run; but only once the
    resume has succeeded."""
    from checkpoint.saving import complete_steps

    folder = tmp_path / "rolled_back"
    shutil.copytree(reference / "checkpoint", folder / "checkpoint")
    rollback = ["--checkpoint.load_step", "5", "--training.steps", "8", "--checkpoint.keep_latest_k", "1"]
    result = run_train([*COMMON, *SINGLE, *rollback, "--job.dump_folder", str(folder)])
    assert "step-10 renamed step-10.abandoned: this run continues from step 5" in result.stdout
    assert complete_steps(folder / "checkpoint") == [8]
    assert (folder / "checkpoint" / "step-10.abandoned" / ".metadata").is_file()
    # A rollback that fails (step-5 damaged) sets nothing aside: the run did not continue from it.
    failed = tmp_path / "failed_rollback"
    shutil.copytree(reference / "checkpoint", failed / "checkpoint")
    data = failed / "checkpoint" / "step-5" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-8] + b"\xff" * 8)
    result = run_train([*COMMON, *SINGLE, *rollback, "--job.dump_folder", str(failed)], check=False)
    assert result.returncode == 2 and "is damaged" in result.stderr
    assert complete_steps(failed / "checkpoint") == [5, 10] and not list(failed.rglob("*.abandoned"))


@pytest.mark.slow
def test_model_only_last_save_starts_a_new_run_but_cannot_continue_one(tmp_path):
    first = tmp_path / "first"
    run_train([*COMMON, *SINGLE, "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16",
               "--job.dump_folder", str(first)])  # fmt: skip
    final = first / "checkpoint" / "step-10"
    more = ["--training.steps", "12", "--job.dump_folder", str(first)]
    result = run_train([*COMMON, *SINGLE, *more], check=False)
    assert "has no optimizer, train, dataloader" in error_line(result)
    second = tmp_path / "second"
    result = run_train(
        [*COMMON, *SINGLE, "--checkpoint.initial_load_path", str(final), "--job.dump_folder", str(second)]
    )
    assert f"initial weights from {final}" in result.stdout
    assert (
        by_step(read_metrics(second))[1]["loss"] < by_step(read_metrics(first))[1]["loss"] - 0.1
    )  # trained weights


def launch_and_stop(command: list[str], env: dict, folder: Path, sig: signal.Signals, log: Path) -> int:
    """Start a launcher script (2 ranks), send sig to the launcher process once training runs past
    any checkpoint the run resumed from, and return its exit code once every process has ended."""
    process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    saved = max((int(p.name[5:]) for p in (folder / "checkpoint").glob("step-*[0-9]")), default=0)
    deadline = time.time() + 120
    while max(logged_steps(folder), default=0) <= saved and process.poll() is None:
        assert time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    started = descendants(process.pid)
    # The launcher is the script's process (multinode.sh execs it) or, under Slurm, the job step's
    # task: the script's child (the fake srun and the task's shell exec it).
    launcher = process.pid if command[1].endswith("multinode.sh") else children()[process.pid][0]
    os.kill(launcher, sig)
    code = process.wait(timeout=120)
    live = lambda: set(started) & {pid for pids in children().values() for pid in pids}
    while live() and time.time() < deadline:  # a worker that outlived its launcher
        time.sleep(0.05)
    assert not live(), log.read_text()[-2000:]
    return code


@pytest.mark.slow
def test_preemption_under_torchrun_saves_exits_0_and_resumes(tmp_path):
    """SIGTERM to scripts/multinode.sh, then SIGUSR1 (Slurm's notice) to the task of
    scripts/slurm.sbatch under a fake Slurm, 2 ranks each, the same train.py arguments: each time
    the workers save and stop, every process ends, the exit code is 0; the second run resumes."""
    folder = tmp_path / "run"
    train_args = [*COMMON, "--training.steps", "100000", "--checkpoint.interval", "100000",
                  "--training.local_batch_size", "4", "--job.dump_folder", str(folder)]  # fmt: skip
    runs = [
        (["bash", str(REPO / "scripts/multinode.sh"), *train_args], signal.SIGTERM,
         dict(os.environ, NNODES="1", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")),
        (["bash", str(REPO / "scripts/slurm.sbatch"), *train_args], signal.SIGUSR1, fake_slurm(tmp_path)),
    ]  # fmt: skip
    saved = []
    for index, (command, sig, env) in enumerate(runs):
        log = tmp_path / f"run{index}.log"
        code = launch_and_stop(command, {**env, "MASTER_PORT": str(free_port())}, folder, sig, log)
        output = log.read_text()
        assert code == 0, output[-3000:]
        stops = re.findall(rf"stopped by {sig.name} after step (\d+): saved (\S+)", output)
        assert len(stops) == 1, output[-3000:]
        step = int(stops[0][0])
        assert stops[0][1] == str(folder / "checkpoint" / f"step-{step}")
        assert (folder / "checkpoint" / f"step-{step}" / "checksums.json").exists()
        if saved:
            assert f"resumed from {folder / 'checkpoint' / f'step-{saved[-1]}'} " in output
        saved.append(step)
    assert saved[0] < saved[1]
    assert [r["step"] for r in read_metrics(folder)] == list(range(1, saved[1] + 1))


@pytest.mark.slow
def test_deepseek_checkpoint_saved_at_pp2_ep2_resumes_at_tp2_and_in_one_process(tmp_path):
    """DeepSeek-V3 (MLA, MoE, one MTP depth) saved at PP 2 x EP 2 (the last stage's copy of the
    embedding beside the first stage's, the stacked experts and their biases sharded over EP) and
    resumed at TP 2 and in one process: the uninterrupted run's losses, MTP's included (PP x EP
    against one process is tests/test_parallel.py's parity, so that run is the reference here)."""
    model = ["--model.name", "deepseek_v3"]
    saved = tmp_path / "pp2_ep2"
    layout = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]
    run_train(
        [*COMMON, *model, *layout, "--training.local_batch_size", "4", "--job.dump_folder", str(saved)],
        nproc=4,
    )
    for name, nproc, overrides in (
        ("tp2", 2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
        ("one", None, SINGLE),
    ):
        folder = resume_from(saved, tmp_path / name)
        run_train([*COMMON, *model, *overrides, "--job.dump_folder", str(folder)], nproc=nproc)
        assert_continues(folder, saved, rel=1e-5)
        want = by_step(read_metrics(saved))
        for step, record in by_step(read_metrics(folder)).items():
            assert record["mtp_loss_1"] == pytest.approx(want[step]["mtp_loss_1"], rel=1e-5), step


@pytest.mark.slow
def test_plain_and_fast_paths_resume_from_each_others_checkpoints(reference, tmp_path):
    """checkpoint.fast_io = false saves through DCP's own writer (here async: DCP's stager, a
    writer thread) with checksums read back; the fast path resumes from its checkpoint, and the
    plain path from the fast path's (the reference's), each on another layout, continuing exactly."""
    plain = tmp_path / "plain"
    args = [*COMMON, "--training.local_batch_size", "4", "--checkpoint.fast_io", "false"]
    run_train([*args, "--checkpoint.async_mode", "async", "--job.dump_folder", str(plain)], nproc=2)
    want = by_step(read_metrics(reference))
    for step, record in by_step(read_metrics(plain)).items():
        assert record["loss"] == pytest.approx(want[step]["loss"], rel=1e-5, abs=0), step
    checkpoint = plain / "checkpoint" / "step-5"
    recorded = json.loads((checkpoint / "checksums.json").read_text())["files"]
    assert sorted(recorded) == sorted(p.name for p in checkpoint.iterdir() if p.name != "checksums.json")

    fast_resumes_plain = resume_from(plain, tmp_path / "a")
    run_train([*COMMON, *SINGLE, "--job.dump_folder", str(fast_resumes_plain)])
    assert_continues(fast_resumes_plain, reference, rel=1e-5)
    plain_resumes_fast = resume_from(reference, tmp_path / "b")
    result = run_train([*args, "--job.dump_folder", str(plain_resumes_fast)], nproc=2)
    assert re.search(r"resumed from .* files read in \S+ s, checked", result.stdout), result.stdout
    assert_continues(plain_resumes_fast, reference, rel=1e-5)


@pytest.mark.slow
def test_muon_checkpoint_resumes_on_other_layouts_and_refuses_another_optimizer(tmp_path):
    """Muon's momentum in DCP: saved at FSDP 2, resumed at FSDP 2 (bitwise), at TP 2 and in one
    process (the uninterrupted run's losses; FSDP 2 against one process is tests/test_parallel.py's
    parity, so that run is the reference here). Resumed with AdamW the checkpoint is refused with
    one error line, unless the optimizer state is left out of loading."""
    muon = ["--optimizer.name", "Muon", "--optimizer.lr", "0.02"]
    saved = tmp_path / "fsdp2"
    run_train([*COMMON, *muon, "--training.local_batch_size", "4", "--job.dump_folder", str(saved)], nproc=2)
    for name, nproc, overrides in (
        ("fsdp2", 2, ["--training.local_batch_size", "4"]),
        ("tp2", 2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
        ("one", None, SINGLE),
    ):
        folder = resume_from(saved, tmp_path / name)
        run_train([*COMMON, *muon, *overrides, "--job.dump_folder", str(folder)], nproc=nproc)
        assert_continues(folder, saved, rel=0 if name == "fsdp2" else 1e-5)
    folder = resume_from(saved, tmp_path / "adamw")
    result = run_train([*COMMON, *SINGLE, "--job.dump_folder", str(folder)], check=False)
    assert error_line(result).startswith(
        f"error: checkpoint {folder / 'checkpoint' / 'step-5'} holds another optimizer's state "
        "(layers.0.attention.wq.weight: momentum_buffer there, exp_avg, exp_avg_sq, step here); "
    )
    assert 'exclude_from_loading = ["optimizer"]' in error_line(result)
    excluded = [
        *COMMON,
        *SINGLE,
        "--checkpoint.exclude_from_loading",
        "optimizer",
        "--job.dump_folder",
        str(folder),
    ]
    run_train(excluded)
    assert sorted(by_step(read_metrics(folder))) == list(range(6, STEPS + 1))
