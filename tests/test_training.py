"""The training loop end to end: lr schedule, gradient accumulation, metrics, torchrun, README."""

import math
import re
import shlex

import pytest
import torch
from conftest import REPO, TINY, read_metrics, run_train

from configs import load_config
from models import get_model_spec
from models.spec import model_args
from training.metrics import lookup_peak_tflops
from training.optimizer import lr_factor

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib"}


def schedule(*argv):
    return load_config(list(argv)).lr_scheduler


def test_warmup_then_linear_decay():
    config = schedule("--lr_scheduler.warmup_steps", "4", "--lr_scheduler.decay_type", "linear")
    factors = [lr_factor(i, 12, config) for i in range(12)]
    assert factors[:4] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert factors[4] == 1.0  # decay starts at the peak
    assert factors[4:] == pytest.approx([1 - j / 8 for j in range(8)])


def test_wsd_cosine_sqrt_and_min_lr():
    wsd = schedule("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.25",
                   "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.min_lr_factor", "0.1")  # fmt: skip
    factors = [lr_factor(i, 10, wsd) for i in range(10)]
    assert factors[2:8] == [1.0] * 6  # stable phase: 8 steps after warmup, the last 2 decay
    assert factors[8] == 1.0 and factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(10, 10, wsd) == pytest.approx(0.1)  # one past the end: the minimum
    sqrt = schedule("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_type", "sqrt")
    assert lr_factor(1, 5, sqrt) == pytest.approx(1 - math.sqrt(1 / 5))


def test_peak_table():
    assert lookup_peak_tflops("NVIDIA H200") == 989.4
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert lookup_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert lookup_peak_tflops("NVIDIA B200") == 2250.0
    assert lookup_peak_tflops("Tesla T4") is None


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    runs = {}
    for local in (4, 2, 1):  # accumulation 1, 2, 4
        folder = tmp_path / f"local{local}"
        run_train([*TINY, "--training.local_batch_size", str(local), "--training.global_batch_size", "4",
                   "--job.dump_folder", str(folder)])  # fmt: skip
        runs[local] = read_metrics(folder)
    reference = runs[4]
    for local in (2, 1):
        for a, b in zip(runs[local], reference):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert len(reference) == 6


def test_metrics_records(tmp_path):
    run_train([*TINY, "--job.dump_folder", str(tmp_path), "--metrics.log_freq", "4",
               "--metrics.enable_tensorboard", "true"])  # fmt: skip
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [4, 6]  # every log_freq steps and the last
    args = model_args(get_model_spec("llama3"), "tiny", 32, 258)
    with torch.device("meta"):
        flops_per_token = get_model_spec("llama3").model_cls(args).flops_per_token(32)
    for record in records:
        assert set(record) == METRIC_KEYS
        assert record["tps"] > 0 and record["memory_gib"] > 0 and record["mfu"] is None  # no peak on CPU
        assert record["tflops"] == pytest.approx(record["tps"] * flops_per_token / 1e12, rel=1e-2, abs=1e-3)
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
    config = load_config(TINY)
    assert records[0]["lr"] == pytest.approx(config.optimizer.lr * lr_factor(3, 6, config.lr_scheduler))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_torchrun_single_process_equals_plain_python(tmp_path):
    args = [*TINY, "--training.steps", "8", "--optimizer.lr", "1e-2"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "python")])
    run_train([*args, "--job.dump_folder", str(tmp_path / "torchrun")], nproc=1)
    plain, launched = read_metrics(tmp_path / "python"), read_metrics(tmp_path / "torchrun")
    assert [r["loss"] for r in plain] == [r["loss"] for r in launched]
    assert launched[-1]["loss"] < launched[0]["loss"] - 0.3  # it learns


def test_readme_train_command(tmp_path):
    """The README's fresh-machine command trains the default config and the loss falls (here cut to
    15 steps; .ci/run runs it in full)."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- ci:commands -->\n```bash\n(.*?)```", readme, re.S).group(1)
    install, train = block.splitlines()[0].split(" && ")
    assert install == "pip install -r requirements.txt"
    argv = shlex.split(train)
    assert argv[:2] == ["python", "train.py"]
    # Run it from a scratch directory (its outputs land there), paths resolved against the repo.
    argv = [str(REPO / a) if (REPO / a).is_file() else a for a in argv[2:]] + [
        "--training.steps",
        "15",
        "--metrics.log_freq",
        "1",
    ]
    result = run_train(argv, cwd=tmp_path, threads=None)
    records = read_metrics(tmp_path / "outputs/llama3_debug")
    assert records[-1]["step"] == load_config(argv).training.steps
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert "step" in result.stdout and "tok/s" in result.stdout and "eta" in result.stdout
    assert block.splitlines()[1] == "python -m pytest -q tests"
    # .ci/run runs both lines as written here.
    ci_lines = (REPO / ".ci/run").read_text().splitlines()
    assert block.splitlines()[0] in ci_lines and "python -m pytest -q tests" in ci_lines
