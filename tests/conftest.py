"""Shared helpers: run train.py (plain or under torchrun) in a subprocess and read its metrics."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Small, fast settings for end-to-end runs on CPU (fp32, one thread per rank): tests/tiny.toml.
TINY = ["--config", str(REPO / "tests" / "tiny.toml")]
# Documents of 1-5 words (~20 tokens): several per window of tests/tiny.toml, for document masking.
SHORT_DOCUMENTS = str(REPO / "tests" / "short_documents.jsonl")


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.pop("WORLD_SIZE", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def train_command(args: list[str], nproc: int | None = None, repo: Path = REPO) -> list[str]:
    """`python train.py ARGS`, or `torchrun --standalone --nproc-per-node N train.py ARGS`."""
    if nproc is None:
        return [sys.executable, str(repo / "train.py"), *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*torchrun, str(repo / "train.py"), *args]


def run_train(
    args: list[str],
    nproc: int | None = None,
    cwd: Path = REPO,
    check: bool = True,
    timeout: int = 600,
    threads: int | None = 1,
    repo: Path = REPO,
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """Run train.py (of repo: a copy of this repository, or itself) to the end.

    One thread per process by default (ranks share the CPU; results do not depend on the core
    count); threads=None leaves torch's default, for a lone process that should use every core.
    Several ranks: a run expected to succeed starts them itself with torchrun's environment
    (run_ranks); a run whose failure the test examines (check=False) goes through torchrun, whose
    output on a failure is what users see, as does every run with torchrun=True (the GPU suite:
    each rank sets up CUDA as under torchrun, nothing forked).
    """
    if nproc is not None and check and not torchrun:
        return run_ranks([sys.executable, str(repo / "train.py"), *args], nproc, cwd, timeout, threads)
    command = train_command(args, nproc, repo)
    process = subprocess.Popen(
        command, cwd=cwd, env=_env(threads), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # A hang: every process of the run prints its threads' Python stacks (faulthandler, on
        # SIGABRT; PYTHONFAULTHANDLER is set), which the failure shows, and is then killed.
        running = descendants(process.pid)
        for pid in running:
            _signal(pid, signal.SIGABRT)
        time.sleep(3)
        for pid in {process.pid, *running, *descendants(process.pid)}:  # (workers started meanwhile too)
            _signal(pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"{' '.join(command)} did not end within {timeout} s; its processes' stacks:\n{stderr[-30000:]}"
        ) from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def free_port() -> int:
    """A port nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(
    command: list[str], nproc: int, cwd: Path = REPO, timeout: int = 600, threads: int | None = 1
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N script ARGS` for a run that must succeed, in less
    time: `command` (`python script ARGS`) on N ranks forked from one process that imported their
    modules once (tests/fork_ranks.py), with the environment torchrun gives its workers (rank 0's
    process group hosts the store) and without torchrun's agent. On the suite's 2 cores this takes a
    4-rank run's start from ~9.6 s to ~4 s. Their outputs joined rank by rank. A rank that fails
    stops the others; one that hangs past timeout prints every rank's Python stacks, as run_train."""
    port = free_port()  # for the store, as torchrun --standalone picks one
    env = dict(_env(threads), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default",
               ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        forks = [command[0], str(REPO / "tests/fork_ranks.py"), folder, str(nproc), *command[1:]]
        parent = subprocess.Popen(forks, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
        try:
            _, failure = parent.communicate(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung, ranks = True, descendants(parent.pid)
            for pid in ranks:
                _signal(pid, signal.SIGABRT)  # (faulthandler: each rank's stacks on its stderr)
            time.sleep(3)
            for pid in [parent.pid, *ranks]:
                _signal(pid, signal.SIGKILL)
            _, failure = parent.communicate()
        outputs = [(Path(folder) / f"{rank}.out", Path(folder) / f"{rank}.err") for rank in range(nproc)]
        stdout = "".join(out.read_text() for out, _ in outputs if out.exists())
        stderr = "".join(err.read_text() for _, err in outputs if err.exists())
    launch = f"{nproc} ranks of {' '.join(command)}"
    if hung:
        raise AssertionError(
            f"{launch} did not end within {timeout} s; its processes' stacks:\n{stderr[-30000:]}"
        )
    if parent.returncode:
        raise AssertionError(f"{launch} failed: {failure.strip()}\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, 0, stdout, stderr)


def start_train(args: list[str], nproc: int | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start train.py in a session of its own, so that a test can kill it with all its ranks."""
    output = log.open("w") if log else subprocess.DEVNULL
    command = train_command(args, nproc)
    return subprocess.Popen(
        command, cwd=REPO, env=_env(1), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )


def children() -> dict[int, list[int]]:
    """Every live process's child processes, by parent."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it just ended
        state, parent = stat.rsplit(")", 1)[1].split()[:2]  # after the command name, which may hold spaces
        if state != "Z":
            found.setdefault(int(parent), []).append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every live process started under pid, nearest first. torchrun starts each worker in a session
    of its own, so killing torchrun's process group leaves the workers running."""
    tree, found, unvisited = children(), [], [pid]
    while unvisited:
        below = tree.get(unvisited.pop(0), [])
        found += below
        unvisited += below
    return found


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """A PATH on which `scontrol` names this host and `srun` runs its command here: enough Slurm
    for scripts/slurm.sbatch on one node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    # srun: drop its own options, run the rest.
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node0",
                SLURM_NNODES="1", SLURM_GPUS_ON_NODE="2", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO),
                MASTER_PORT="29518", OMP_NUM_THREADS="1")  # fmt: skip


def read_metrics(dump_folder: Path) -> list[dict]:
    lines = (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def single_process_runs(tmp_path_factory):
    """Single-process reference runs shared by the test modules, made on first use and kept by their
    exact arguments (test_parallel.py and test_speed_features.py build them alike)."""
    made = {}

    def run(args: list[str]) -> list[dict]:
        if tuple(args) not in made:
            folder = tmp_path_factory.mktemp("single")
            run_train([*args, "--job.dump_folder", str(folder)])
            made[tuple(args)] = read_metrics(folder)
        return made[tuple(args)]

    return run


def write_token_source(folder: Path, tokens, tokenizer_id: str = "bytes", dtype: str = "uint16",
                       vocab_size: int = 258) -> Path:  # fmt: skip
    """A token-shard folder as scripts/prepare_data.py writes it, holding `tokens` (one shard)."""
    import numpy as np

    from data.shards import write_meta

    folder.mkdir(parents=True)
    np.asarray(tokens).astype(dtype).tofile(folder / "tokens-00000.bin")
    shards = [{"file": "tokens-00000.bin", "num_tokens": len(tokens)}]
    write_meta(folder, dtype, vocab_size, vocab_size - 1, "test", tokenizer_id, shards)
    return folder


def write_mixture(root: Path, sizes: dict[str, int], seed: int = 0) -> list[Path]:
    """Token-shard sources of random byte tokens, `sizes[name]` tokens each, under root."""
    import numpy as np

    generator = np.random.default_rng(seed)
    return [write_token_source(root / name, generator.integers(0, 256, size)) for name, size in sizes.items()]
