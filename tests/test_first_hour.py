"""A new user's first hour (the README, followed): the debug recipes give the same losses on one
process and on two, Ctrl-C under the launcher saves once and exits 130 with no traceback, the export
loads and generates in transformers as the README shows, and the plots tell identical runs apart."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, TINY, read_metrics, run_train

from checkpoint import hf
from configs import load_config
from models import get_model_spec
from models.spec import model_args
from scripts.plot_metrics import legend_labels

LAUNCHER = [sys.executable, str(REPO / "scripts/torchrun_with_stop_signals.py"), "--standalone"]
# Each debug recipe on two processes: FSDP 2, and for the MoE one its experts over both (EP 2).
TWO_PROCESSES = {"llama3_debug": [], "qwen3_moe_debug": ["--parallelism.expert_parallel_degree", "2"]}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TWO_PROCESSES)
def test_debug_recipe_gives_the_same_loss_on_one_process_and_two(recipe, tmp_path):
    """The recipe's own global batch (8) on both, so step 4's loss is the same; shorter sequences
    and fewer steps than the recipe's (logged at the last) keep the test short."""
    args = [
        "--config",
        str(REPO / f"configs/{recipe}.toml"),
        "--training.steps",
        "4",
        "--metrics.log_freq",
        "4",
        "--training.seq_len",
        "64",
    ]
    args += ["--training.device", "cpu", "--metrics.enable_tensorboard", "false"]
    one = run_train([*args, "--job.dump_folder", str(tmp_path / "one")]).stdout
    two = run_train(
        [*args, *TWO_PROCESSES[recipe], "--job.dump_folder", str(tmp_path / "two")], nproc=2
    ).stdout
    assert "global batch 8 x 64 tokens (4 per micro-batch x 1 data-parallel x 2 accumulation)" in one
    assert "global batch 8 x 64 tokens (4 per micro-batch x 2 data-parallel x 1 accumulation)" in two
    (single,), (double,) = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert single["step"] == double["step"] == 4
    assert double["loss"] == pytest.approx(single["loss"], rel=1e-5)
    # What the run reads is the data line's to say, not the description's.
    description = load_config(args).job.description
    assert f" {description}\n" in one and "data: text 'python_docs'" in one
    assert not re.search("python|sample|docs", description, flags=re.I)
    # On a CPU the progress line has no TFLOP/s (0.0) or MFU (no peak); metrics.jsonl keeps both.
    progress = [line for line in one.splitlines() if re.search(r"step +4 \| loss", line)]
    assert len(progress) == 1 and "tflops" not in progress[0] and "mfu" not in progress[0]
    assert "on CPU the progress line leaves out tflops and mfu" in one and {"tflops", "mfu"} <= set(single)


def launch(args: list[str], **options) -> subprocess.Popen:
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    environment.pop("WORLD_SIZE", None)
    command = [*LAUNCHER, "--nproc-per-node", "2", str(REPO / "train.py"), *args]
    return subprocess.Popen(command, cwd=REPO, env=environment, text=True, **options)


@pytest.mark.slow
def test_ctrl_c_under_the_launcher_saves_once_and_exits_130(tmp_path):
    folder, log = tmp_path / "run", tmp_path / "log"
    args = [
        *TINY,
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--checkpoint.enable",
    ]
    args += [
        "--checkpoint.interval",
        "1000",
        "--job.signal_check_interval",
        "2",
        "--job.dump_folder",
        str(folder),
    ]
    # In a session of its own, so that the test can send what a terminal's Ctrl-C sends: SIGINT to
    # the launcher's whole process group.
    process = launch([*args, "--training.steps", "500"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                     start_new_session=True)  # fmt: skip
    deadline = time.time() + 240
    while not re.search(r"step +2 \|", log.read_text()):
        assert process.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=240) == 130, log.read_text()[-3000:]
    output = log.read_text()
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    (saved,) = (folder / "checkpoint").glob("step-*")  # one save
    assert output.count("saved checkpoint") == 1 and "training stopped" in output
    # The same command resumes, here in micro-batches of 1 (the same global batch): said in one line.
    step = int(saved.name.removeprefix("step-"))
    more = ["--training.steps", str(step + 2), "--training.local_batch_size", "1"]
    rerun = launch([*args, *more], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = rerun.communicate(timeout=240)[0]
    assert rerun.returncode == 0, output[-3000:]
    assert f"resumed from {saved}" in output
    assert "training.local_batch_size changed from 2 to 1, the global batch stays 4" in output
    assert [r["step"] for r in read_metrics(folder)][-2:] == [step + 1, step + 2]


def readme_export_snippet() -> str:
    """The README's Python block: loading the export in transformers and generating from it."""
    (snippet,) = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return snippet


@pytest.mark.slow
def test_readme_export_snippet_generates(tmp_path):
    spec = get_model_spec("llama3")
    args = model_args(spec, "tiny", 32, 258)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    state = {name: p.detach() for name, p in model.named_parameters()}
    hf.save(state, spec.state_dict_adapter(args), tmp_path / "hf", torch.float32, hf_assets_path="")
    snippet = readme_export_snippet()
    assert '"outputs/hf/llama3_debug_step50"' in snippet  # the README's export command's --output
    snippet = snippet.replace("outputs/hf/llama3_debug_step50", str(tmp_path / "hf"))
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("def ") and len(result.stdout) > len("def \n")


def test_plot_legend_tells_identical_runs_apart():
    same = {1: {"loss": 5.0}, 2: {"loss": 4.0}}
    runs = {"one": same, "fsdp2": dict(same), "other": {1: {"loss": 5.0}, 2: {"loss": 3.9}}}
    assert legend_labels(runs, "loss") == ["one", "fsdp2 (loss identical to one)", "other"]
