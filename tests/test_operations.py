"""Running real jobs: the non-finite guard, validation, profiling, launchers, plots, dry runs."""

import gzip
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, fake_slurm, read_metrics, run_train

from training.nonfinite import NonFiniteError, NonFiniteGuard

# lr 1e30 wrecks the weights at step 1, so from step 2 on the loss and the gradients are not finite.
EXPLODE = [*TINY, "--training.steps", "6", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"]


def test_nonfinite_step_stops_and_nothing_after_it_is_saved(tmp_path):
    """The guard runs on the device and is read at logging (every 4 steps here) and before every save
    (step 3): the save is refused, the error names the first bad step."""
    saving = ["--metrics.log_freq", "4", "--checkpoint.enable", "--checkpoint.interval", "3"]
    result = run_train([*EXPLODE, *saving, "--job.dump_folder", str(tmp_path)], check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith("error: step 2: the loss or the gradients are not finite")
    assert "no update made from that step on" in errors[0]
    assert not (tmp_path / "checkpoint" / "step-3").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_nonfinite_steps_skipped_up_to_a_limit(tmp_path):
    skip = ["--training.nonfinite_policy", "skip", "--training.max_skipped_steps", "2"]
    result = run_train([*EXPLODE, *skip, "--job.dump_folder", str(tmp_path)], check=False)
    assert result.returncode == 1
    assert result.stdout.count("update was skipped") == 2
    assert "error: step 4: the loss or the gradients are not finite" in result.stderr
    assert "3 steps skipped, more than training.max_skipped_steps (2)" in result.stderr


class Untouchable(torch.Tensor):
    """A tensor that fails when the host reads it (as a device synchronization would)."""

    def __bool__(self):
        raise AssertionError("read on the host")

    item = __int__ = __float__ = __bool__


def test_guard_decides_on_the_device_and_reads_only_in_check():
    nan, finite = float("nan"), 2.0
    untouchable = lambda value: torch.tensor(value).as_subclass(Untouchable)
    cpu = torch.device("cpu")
    assert NonFiniteGuard("off", 0, cpu).skip_update(untouchable(nan), 3) is None
    flags = []
    for guard in (NonFiniteGuard("stop", 0, cpu), NonFiniteGuard("skip", 5, cpu)):
        flags.append([guard.skip_update(untouchable(norm), step).tolist() for step, norm in
                      ((2, finite), (3, nan), (4, finite))])  # fmt: skip
    assert flags == [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]  # stop: every later update is skipped too
    guard = NonFiniteGuard("stop", 0, cpu)
    for step, norm in ((2, finite), (3, nan), (4, finite)):
        guard.skip_update(torch.tensor(norm), step)
    with pytest.raises(NonFiniteError, match="step 3"):
        guard.check()


VALIDATE = [*TINY, "--training.steps", "4", "--training.global_batch_size", "8", "--validation.enable",
            "--validation.freq", "2", "--validation.steps", "2", "--validation.dataset", "python_docs"]  # fmt: skip


@pytest.fixture(scope="module")
def validated_single(tmp_path_factory):
    """The single-process run with validation every 2 steps: its console output and records."""
    folder = tmp_path_factory.mktemp("validated_single")
    console = run_train(
        [*VALIDATE, "--training.local_batch_size", "8", "--job.dump_folder", str(folder)]
    ).stdout
    return console, read_metrics(folder)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, overrides",
    # (data parallel: tests/test_fault_tolerance.py compares validation across FSDP 2 and replica groups)
    [(2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
     (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"])],
    ids=["pp2", "cp2"],
)  # fmt: skip
def test_validation_loss_is_the_same_on_every_layout(nproc, overrides, validated_single, tmp_path):
    console, single = validated_single
    assert "step 2 | validation loss" in console and "step 4 | validation loss" in console
    other = tmp_path / "other"
    run_train([*VALIDATE, *overrides, "--job.dump_folder", str(other)], nproc=nproc)
    want = {r["step"]: r for r in single if "val_loss" in r}
    got = {r["step"]: r for r in read_metrics(other) if "val_loss" in r}
    assert sorted(want) == sorted(got) == [2, 4]
    for step in want:
        assert got[step]["val_loss"] == pytest.approx(want[step]["val_loss"], rel=1e-5)
        assert got[step]["val_perplexity"] == pytest.approx(math.exp(want[step]["val_loss"]), rel=1e-4)
    assert want[4]["val_loss"] < want[2]["val_loss"]


def test_profiler_traces_chosen_steps(tmp_path):
    profile = ["--profiling.enable", "--profiling.start_step", "3", "--profiling.steps", "2"]
    run_train([*TINY, *profile, "--job.dump_folder", str(tmp_path)])
    files = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert files == ["rank0_step3-4.json.gz", "rank0_step3-4.txt"]
    assert "aten::mm" in (tmp_path / "profiles" / "rank0_step3-4.txt").read_text()


def test_profile_summary_gives_each_compiled_kernels_bandwidth(tmp_path):
    """A trace of two steps and inductor's generated code (as with TORCHINDUCTOR_BENCHMARK_KERNEL=1):
    each Triton kernel's bytes and TB/s; a name that is a prefix of another is not mixed up with it."""
    calls = {"triton_red_fused_amax_1": (250, 3), "triton_red_fused_amax_12": (100, 1), "nvjet": (900, 1)}
    events, clock = [], 0
    for name, (microseconds, per_step) in calls.items():
        for _ in range(2 * per_step):
            events.append({"cat": "kernel", "name": name, "ts": clock, "dur": microseconds})
            clock += microseconds + 1
    trace = tmp_path / "rank0_step5-6.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    code = tmp_path / "inductor" / "ab"
    code.mkdir(parents=True)
    (code / "cab.py").write_text("".join(
        f"{name} = async_compile.triton('{name}', \'\'\'\n@triton_heuristics.reduction(inductor_meta="
        f"{{'kernel_num_gb': {gb}}})\ndef {name}(in_ptr0):\n    pass\n\'\'\')\n\n"
        for name, gb in (("triton_red_fused_amax_1", 0.5), ("triton_red_fused_amax_12", 0.3))))  # fmt: skip
    summary = subprocess.run([sys.executable, str(REPO / "scripts/profile_summary.py"), str(trace),
                              "--inductor-code", str(tmp_path / "inductor")],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
    lines = {line.split("] ")[1].split()[0]: line for line in summary.splitlines() if "] " in line}
    assert lines["triton_red_fused_amax_1"].endswith("0.500 GB, 2.00 TB/s")  # 0.5 GB in 0.25 ms
    assert lines["triton_red_fused_amax_12"].endswith("0.300 GB, 3.00 TB/s")
    assert "GB" not in lines["nvjet"]


def test_profile_summary_lists_idle_gaps_with_the_late_launch(tmp_path):
    """--gaps: the longest idle gaps first, with how late the host launched the kernel after each
    and what the host was running then (annotations outermost first, then the innermost operator)."""

    def kernel(name, ts, dur, correlation):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    def host(cat, name, ts, dur):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7}

    events = [
        kernel("nvjet_a", 0, 100, 1), kernel("nvjet_b", 100, 50, 2),  # back to back
        kernel("triton_update", 400, 10, 3),  # 250 us idle, launched 230 us into the gap
        kernel("nvjet_c", 420, 30, 4),  # 10 us idle, launched before the gap
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 380, "dur": 5, "tid": 7, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 200, "dur": 5, "tid": 7, "args": {"correlation": 4}},
        host("user_annotation", "ProfilerStep#5", 0, 1000), host("user_annotation", "Optimizer.step", 300, 100),
        host("cpu_op", "aten::copy_", 370, 20), host("cpu_op", "aten::add_", 360, 40),
    ]  # fmt: skip
    trace = tmp_path / "rank0_step5-6.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = subprocess.run([sys.executable, str(REPO / "scripts/profile_summary.py"), str(trace), "--gaps", "1"],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
    gaps = summary.split("longest 1 idle gaps:\n")[1].splitlines()
    assert (
        gaps[0].split()[:2] == ["0.250", "ms"]
        and "after nvjet_b" in gaps[0]
        and "before triton_update" in gaps[0]
    )
    assert "launched +0.230 ms into the gap" in gaps[1]
    assert gaps[1].endswith("host: ProfilerStep#5 > Optimizer.step > aten::copy_")
    assert len(gaps) == 2  # one gap asked for


def test_plot_metrics_draws_runs(tmp_path):
    """Two runs' records as train.py writes them (training records, validation records of the same
    step, a step redone after a resume): one PNG."""
    for name, scale in (("a", 1.0), ("b", 1.1)):
        records = [{"step": s, "loss": scale * (5 - s / 3), "grad_norm": 1.0, "lr": 1e-3, "tps": 100.0,
                    "memory_gib": 0.3} for s in range(1, 7)]  # fmt: skip
        records.insert(3, {"step": 3, "val_loss": scale * 4.2, "val_perplexity": 66.7})
        records.append({**records[-1], "loss": 2.0})  # step 6 again, after a resume
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    output = tmp_path / "curves.png"
    subprocess.run([sys.executable, str(REPO / "scripts/plot_metrics.py"), str(tmp_path / "a/metrics.jsonl"),
                    str(tmp_path / "b"), "--output", str(output)], check=True)  # fmt: skip
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000


@pytest.mark.slow
def test_multinode_launcher_runs_one_node(tmp_path):
    env = dict(os.environ, NNODES="1", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517",
               OMP_NUM_THREADS="1")  # fmt: skip
    args = [*TINY, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path)]
    result = subprocess.run(["bash", str(REPO / "scripts/multinode.sh"), "--config", str(REPO / "configs/llama3_debug.toml"), *args],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(read_metrics(tmp_path)) == 6


@pytest.mark.slow
def test_slurm_script_trains_with_its_arguments(tmp_path):
    args = [
        *TINY,
        "--training.steps",
        "3",
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    result = subprocess.run(["bash", str(REPO / "scripts/slurm.sbatch"), "--config", str(REPO / "configs/llama3_debug.toml"), *args],
                            env=fake_slurm(tmp_path), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert "dp_shard 2" in result.stdout  # torchrun started one rank per GPU Slurm gave the node


@pytest.mark.slow
def test_dry_run_prints_the_layout_without_training(tmp_path):
    result = run_train(["--config", str(REPO / "configs/llama3_8b.toml"), "--job.dry_run",
                        "--job.dry_run_world_size", "16", "--parallelism.tensor_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_degree", "2", "--job.dump_folder", str(tmp_path)])  # fmt: skip
    out = result.stdout
    assert "world 16 = pp 2 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 2" in out
    # Each pipeline stage's first rank, then the largest estimate.
    assert "rank 0 (pipeline stages [0] of 2): " in out and "rank 8 (pipeline stages [1] of 2): " in out
    assert "estimated memory per rank: " in out and "GiB at most" in out
    assert not (tmp_path / "metrics.jsonl").exists()
    # Qwen3-MoE 235B-A22B at world 64 with expert parallelism 8, in this one process.
    moe = run_train([*TINY, "--model.name", "qwen3_moe", "--model.flavor", "235B-A22B", "--training.seq_len", "4096",
                     "--training.local_batch_size", "1", "--job.dry_run", "--job.dry_run_world_size", "64",
                     "--parallelism.expert_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "4",
                     "--job.dump_folder", str(tmp_path)]).stdout  # fmt: skip
    assert "(experts: ep 8 of dp_shard x cp)" in moe and "235,093,634,560 parameters" in moe


def test_estimate_memory_counts_each_ranks_shards():
    command = [sys.executable, str(REPO / "scripts/estimate_memory.py"), "--world-size", "64", "--",
               "--config", str(REPO / "configs/llama3_70b.toml"), "--parallelism.tensor_parallel_degree", "8"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    estimate = __import__("json").loads(result.stdout.strip().splitlines()[-1])
    # FSDP 8 x TP 8 splits every matrix 64 ways; norm weights are replicated over TP (8 ways).
    norms = (80 * 2 + 1) * 8192
    assert estimate["parameters"] == (70_553_706_496 - norms) // 64 + norms // 8
    assert estimate["weights_gib"] == pytest.approx(4 * estimate["parameters"] / 2**30, abs=0.01)
    assert estimate["optimizer_gib"] == pytest.approx(2 * estimate["weights_gib"], abs=0.02)
    assert 0 < estimate["activations_gib"] < estimate["total_gib"]


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_with_one_error_line_after_the_timeout(tmp_path):
    """Rank 1 stopped (SIGSTOP) mid-run: rank 0 waits job.collective_timeout_s in its next
    collective, then the run ends with one `error:` line that says a rank is hung or gone."""
    import re
    import signal
    import time

    from conftest import descendants, start_train

    log = tmp_path / "log.txt"
    args = [
        *TINY,
        "--training.steps",
        "1000",
        "--job.collective_timeout_s",
        "8",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    process = start_train(args, nproc=2, log=log)
    deadline = time.time() + 120
    while not re.search(r"step +3 \|", log.read_text()) and time.time() < deadline and process.poll() is None:
        time.sleep(0.5)
    workers = [pid for pid in descendants(process.pid) if "train.py" in open(f"/proc/{pid}/cmdline").read()]
    rank1 = [pid for pid in workers if "RANK=1\0" in open(f"/proc/{pid}/environ").read()]
    os.kill(rank1[0], signal.SIGSTOP)
    started = time.time()
    try:  # (torchrun then waits for the stopped rank before killing it: not what is tested)
        while "error:" not in log.read_text() and time.time() - started < 60:
            time.sleep(0.5)
        time.sleep(1)
    finally:
        for pid in descendants(process.pid) + [process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    output = log.read_text()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "waited job.collective_timeout_s = 8 s in a collective" in errors[0], output[
        -3000:
    ]
    assert "another rank is hung or gone" in errors[0] and "Timed out waiting" not in output
    assert 8 <= time.time() - started < 60


# Loaded by train.py (PYTHONPATH): the process sends itself $STOP_SIGNAL as the checkpoint starts
# loading, so that the signal comes during start-up whatever the machine's speed.
SIGNAL_DURING_LOAD = """
import os, signal, sys
if sys.argv and sys.argv[0].endswith("train.py"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    import checkpoint.manager
    load = checkpoint.manager.Checkpointer.load
    def load_after_a_signal(self):
        os.kill(os.getpid(), signal.Signals[os.environ["STOP_SIGNAL"]])
        return load(self)
    checkpoint.manager.Checkpointer.load = load_after_a_signal
"""


@pytest.mark.slow
def test_a_stop_signal_during_start_up_stops_before_the_first_step(tmp_path, monkeypatch):
    """SIGTERM, then Ctrl-C, while the checkpoint of step 2 loads: the run stops before step 3 with a
    line that says so and no traceback, logs no step, saves nothing (the checkpoint it has just
    loaded is the latest) and exits 0, or 130 after Ctrl-C, as a stop after a step does."""
    folder = tmp_path / "run"
    args = [*TINY, "--checkpoint.enable", "--job.dump_folder", str(folder)]
    run_train([*args, "--training.steps", "2"])
    (tmp_path / "sitecustomize.py").write_text(SIGNAL_DURING_LOAD)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for name, code in (("SIGTERM", 0), ("SIGINT", 130)):
        monkeypatch.setenv("STOP_SIGNAL", name)
        result = run_train([*args, "--training.steps", "4"], check=False)
        output = result.stdout + result.stderr
        assert result.returncode == code and "Traceback" not in output, output[-3000:]
        assert (
            f"stopped by {name} during start-up, before step 3: no checkpoint saved (nothing new since the "
            "checkpoint of step 2 it resumed from)" in result.stdout
        ), output[-3000:]
        assert [record["step"] for record in read_metrics(folder)] == [1, 2]
        assert [path.name for path in (folder / "checkpoint").iterdir()] == ["step-2"]
