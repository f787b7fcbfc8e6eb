"""A checkpoint is read as data only: a pickled payload planted in it, with checksums.json recomputed
as an attacker would, is refused with one error line and runs nothing, on every path that reads a
checkpoint (resume, checkpoint.initial_load_path, scripts/convert_dcp_to_hf.py); an honest one still
resumes bitwise. The launchers pass paths and arguments on without a shell reading them again.
docs/checkpointing.md, "Trust model".

One real checkpoint is saved for the module; the train.py cases run in one process
(tests/catalog_runner.py), so the module costs two train.py starts, one conversion and one launch.
"""

import dataclasses
import io
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, fake_slurm, free_port, read_metrics, run_train
from test_bad_inputs import run_catalog

from checkpoint import integrity

ARGS = [*TINY, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
SYSTEM = f"{os.system.__module__}.system"  # how a pickle names os.system ("posix.system")


def refusal(checkpoint: Path, where: str) -> str:
    """The error line of a checkpoint refused for a Payload planted in `where`."""
    return (
        f"error: checkpoint {checkpoint} holds a pickled object of a kind a checkpoint never holds "
        f"({SYSTEM} in {where}); it was not loaded"
    )


class Payload:
    """What an attacker plants: unpickled, it runs a shell command, which creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(checkpoint: Path, where: str, marker: Path, recompute_checksums: bool = True) -> None:
    """A Payload into checkpoint's .metadata or into the byte record `where` (for train.rng: into the
    pickle that record holds), then checksums.json recomputed with the repository's own code."""
    with (checkpoint / ".metadata").open("rb") as f:
        metadata = pickle.load(f)  # (the test's own honest checkpoint)
    if where == ".metadata":
        metadata.planted = Payload(marker)
    else:  # a new record appended to the data file, the record's entry pointed at it
        index = next(index for index in metadata.storage_data if index.fqn == where)
        entry = metadata.storage_data[index]
        record = io.BytesIO()
        torch.save(pickle.dumps(Payload(marker)) if where == "train.rng" else Payload(marker), record)
        data_file = checkpoint / entry.relative_path
        offset = data_file.stat().st_size
        with data_file.open("ab") as f:
            f.write(record.getvalue())
        metadata.storage_data[index] = dataclasses.replace(
            entry, offset=offset, length=len(record.getvalue())
        )
    with (checkpoint / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    if recompute_checksums:
        integrity.record(checkpoint)


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> Path:
    """A run of 4 steps that saved step-2 and step-4."""
    folder = tmp_path_factory.mktemp("honest")
    run_train([*ARGS, "--job.dump_folder", str(folder)])
    return folder


@pytest.fixture(scope="module")
def outcomes(honest, tmp_path_factory) -> dict[str, dict]:
    """By case: a folder holding a copy of the honest step-2 with a Payload planted (none for
    "honest"), the Payload's marker file, and what train.py's main() returned and printed to stderr
    when it resumed from that copy (for "initial weights": started from it, initial_load_path)."""
    root = tmp_path_factory.mktemp("cases")
    planted = {"honest": None, "metadata": ".metadata", "record": "train.step", "rng": "train.rng",
               "unrecorded metadata": ".metadata", "initial weights": ".metadata"}  # fmt: skip
    cases, argvs = {}, []
    for name, where in planted.items():
        folder, marker = root / name.replace(" ", "_"), root / f"{name.replace(' ', '_')}.ran"
        checkpoint = folder / "checkpoint" / "step-2"
        shutil.copytree(honest / "checkpoint" / "step-2", checkpoint)
        if where is not None:
            plant(checkpoint, where, marker, recompute_checksums=name != "unrecorded metadata")
        cases[name] = {"checkpoint": checkpoint, "marker": marker, "folder": folder}
        if name == "initial weights":
            argvs.append([*TINY, "--checkpoint.initial_load_path", str(checkpoint), "--job.dump_folder",
                          str(folder / "new_run")])  # fmt: skip
        else:
            argvs.append([*ARGS, "--job.dump_folder", str(folder)])
    for case, result in zip(cases.values(), run_catalog(argvs, root)):
        case.update(result)
    return cases


def error_line(outcome: dict) -> str:
    """The run's one `error:` line; the run stopped with exit code 2 and no traceback."""
    errors = [line for line in outcome["stderr"].splitlines() if line.startswith("error:")]
    stderr = outcome["stderr"]
    assert outcome["code"] == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


@pytest.mark.parametrize(
    "case, where", [("metadata", ".metadata"), ("record", "train.step"), ("rng", "train.rng")]
)
def test_resume_refuses_a_planted_payload_and_runs_nothing(outcomes, case, where):
    outcome = outcomes[case]
    assert not outcome["marker"].exists()
    assert error_line(outcome) == refusal(outcome["checkpoint"], where)


def test_initial_load_path_refuses_a_planted_payload_and_runs_nothing(outcomes):
    outcome = outcomes["initial weights"]
    assert not outcome["marker"].exists()
    assert error_line(outcome) == refusal(outcome["checkpoint"], ".metadata")


def test_metadata_is_checked_against_its_checksum_before_it_is_unpickled(outcomes):
    """A .metadata changed without recomputing checksums.json is refused as damaged: unread."""
    outcome = outcomes["unrecorded metadata"]
    assert not outcome["marker"].exists()
    assert error_line(outcome).startswith(
        f"error: checkpoint {outcome['checkpoint']} is damaged: .metadata is "
    )


def test_an_honest_checkpoint_still_resumes_bitwise(outcomes, honest):
    outcome = outcomes["honest"]
    assert outcome["code"] == 0, outcome["stderr"]
    resumed = {r["step"]: r["loss"] for r in read_metrics(outcome["folder"]) if "loss" in r}
    want = {r["step"]: r["loss"] for r in read_metrics(honest) if "loss" in r}
    assert sorted(resumed) == [3, 4] and all(resumed[step] == want[step] for step in resumed)


def test_convert_dcp_to_hf_refuses_a_planted_payload_and_runs_nothing(honest, tmp_path):
    checkpoint, marker = tmp_path / "step-2", tmp_path / "ran"
    shutil.copytree(honest / "checkpoint" / "step-2", checkpoint)
    plant(checkpoint, ".metadata", marker)
    command = [sys.executable, str(REPO / "scripts/convert_dcp_to_hf.py"), "--checkpoint", str(checkpoint),
               "--output", str(tmp_path / "hf"), "--config", str(honest / "config.toml")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    assert not marker.exists()
    assert result.returncode == 2 and not (tmp_path / "hf").exists(), result.stderr
    assert result.stderr.strip() == refusal(checkpoint, ".metadata")


def test_slurm_passes_a_submit_folder_with_quotes_as_a_path(tmp_path):
    """scripts/slurm.sbatch from a submit folder named x'$(touch pwned)'y: nothing runs, and the
    arguments reach train.py intact (--help, to stay fast)."""
    submit = tmp_path / "x'$(touch pwned)'y"
    submit.symlink_to(REPO, target_is_directory=True)
    env = {**fake_slurm(tmp_path), "SLURM_SUBMIT_DIR": str(submit), "SLURM_GPUS_ON_NODE": "1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    result = subprocess.run(["bash", str(REPO / "scripts/slurm.sbatch"), "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert not (tmp_path / "pwned").exists() and not (REPO / "pwned").exists()
    assert result.returncode == 0 and "Pretrain a language model" in result.stdout, result.stderr[-2000:]


def test_fault_tolerance_launcher_takes_only_numbers_for_its_counts(tmp_path):
    """scripts/fault_tolerance_local.sh does arithmetic with REPLICA_GROUPS, which bash evaluates as
    an expression, running the $(...) of an index (here of its own variable nproc; the count comes
    out 0, so the old script started no group): anything but a number is refused before any use."""
    env = {**os.environ, "REPLICA_GROUPS": f"nproc[$(touch {tmp_path}/pwned)]-1"}
    command = ["bash", str(REPO / "scripts/fault_tolerance_local.sh"), *TINY, "--job.dump_folder",
               str(tmp_path / "run")]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert not (tmp_path / "pwned").exists()
    assert result.returncode == 2 and result.stderr.startswith("error: REPLICA_GROUPS"), result.stderr
