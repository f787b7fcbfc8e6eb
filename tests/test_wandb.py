"""Weights & Biases, offline (metrics.enable_wandb, WANDB_MODE=offline): the scalars TensorBoard gets,
at the same steps, and a resume that continues the same W&B run."""

import json
import os
import struct
from pathlib import Path
from unittest import mock

import pytest
from conftest import TINY, read_metrics, run_train

from configs import UserError, load_config

W_AND_B_OWN = {"_runtime", "_step", "_timestamp"}  # keys W&B adds to every history row


def offline_records(path: Path):
    """The records of an offline run's .wandb file: LevelDB's log format (32 KiB blocks of chunks,
    each with a 7-byte header: checksum, length, type) after a 7-byte W&B header, each record one
    protobuf message."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_offline_runs(wandb_folder: Path) -> tuple[list[str], dict[int, dict]]:
    """(the run id of each offline run in the folder, in order; the history rows by step)."""
    ids, rows = [], {}
    for run_file in sorted(wandb_folder.glob("offline-run-*/run-*.wandb")):
        for record in offline_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                rows[row["_step"]] = {key: value for key, value in row.items() if key not in W_AND_B_OWN}
    return ids, rows


def tensorboard_scalars(folder: Path) -> dict[int, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    rows: dict[int, dict] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            rows.setdefault(event.step, {})[tag] = event.value
    return rows


@pytest.mark.slow
def test_offline_run_logs_tensorboards_scalars_and_resumes_the_same_run(tmp_path):
    folder = tmp_path / "run"
    args = [*TINY, "--checkpoint.enable", "--metrics.enable_wandb", "--metrics.enable_tensorboard"]
    args += ["--metrics.wandb_project", "tests", "--job.dump_folder", str(folder)]
    environment = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with mock.patch.dict(os.environ, environment):
        os.environ.pop("WANDB_DIR", None)  # the files go under the dump folder
        run_train([*args, "--training.steps", "3"])
        run_train([*args, "--training.steps", "5"])  # resumes from step 3
    ids, wandb_rows = read_offline_runs(folder / "wandb")
    assert len(ids) == 2 and ids[0] == ids[1] == (folder / "wandb/run_id").read_text().strip()
    assert sorted(wandb_rows) == [1, 2, 3, 4, 5]
    board = tensorboard_scalars(folder / "tb")
    for step, row in wandb_rows.items():
        assert set(row) == set(board[step]), step
        for name, value in row.items():  # TensorBoard stores float32
            assert value == pytest.approx(board[step][name], rel=1e-6), (step, name)
    assert [wandb_rows[r["step"]]["loss"] for r in read_metrics(folder)] == [
        r["loss"] for r in read_metrics(folder)
    ]


def test_enabled_without_the_package_is_one_error_line():
    with mock.patch("importlib.util.find_spec", return_value=None):
        with pytest.raises(
            UserError, match="metrics.enable_wandb needs the wandb package: pip install wandb"
        ):
            load_config([*TINY, "--metrics.enable_wandb"])
