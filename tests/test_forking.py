"""docs/forking.md, followed literally: copy the Llama folder, change RMSNorm to LayerNorm, register
the copy with one line, train it under FSDP 2 and TP 2 (the two must agree), and export it (its
LayerNorm biases have no Hugging Face names: one error line says what to add).

The fork is made in a copy of the repository, under a name no user would give theirs (the guide's
own `mymodel` may already be the user's fork in the copied tree)."""

import shutil
import subprocess
import sys

import pytest
from conftest import REPO, TINY, read_metrics, run_train

NAME = "forking_guide_test_model"  # the guide's "mymodel"


def fork(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(".git", "outputs", "__pycache__", ".whl"))
    # 1. Copy a folder (and point its imports at the copy).
    shutil.copytree(repo / "models/llama3", repo / f"models/{NAME}")
    for file in (repo / f"models/{NAME}").glob("*.py"):
        file.write_text(file.read_text().replace("models.llama3", f"models.{NAME}"))
    # 2. Edit the model: LayerNorm instead of RMSNorm.
    model = repo / f"models/{NAME}/model.py"
    model.write_text(model.read_text().replace("nn.RMSNorm", "nn.LayerNorm"))
    # 3. Register it: the spec's name, and one line in models/__init__.py.
    package = repo / f"models/{NAME}/__init__.py"
    package.write_text(package.read_text().replace('name="llama3"', f'name="{NAME}"'))
    registry = repo / "models/__init__.py"
    line = '    "llama3": "models.llama3",\n'
    assert registry.read_text().count(line) == 1
    registry.write_text(registry.read_text().replace(line, line + f'    "{NAME}": "models.{NAME}",\n'))
    return repo


@pytest.mark.slow
def test_forked_model_trains_under_fsdp_and_tp(tmp_path):
    repo = fork(tmp_path)
    assert "LayerNorm" in (repo / f"models/{NAME}/model.py").read_text()
    args = [*TINY, "--model.name", NAME, "--training.steps", "8", "--training.global_batch_size", "8"]
    args += ["--optimizer.lr", "1e-2"]  # high enough that 8 steps visibly learn
    fsdp2 = [
        "--training.local_batch_size",
        "4",
        "--checkpoint.enable",
        "--job.dump_folder",
        str(tmp_path / "fsdp2"),
    ]
    fsdp = run_train([*args, *fsdp2], nproc=2, repo=repo, cwd=repo)
    tp2 = ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]
    tp = run_train([*args, *tp2, "--job.dump_folder", str(tmp_path / "tp2")], nproc=2, repo=repo, cwd=repo)
    assert f"model {NAME} tiny" in fsdp.stdout and f"model {NAME} tiny" in tp.stdout
    a, b = read_metrics(tmp_path / "fsdp2"), read_metrics(tmp_path / "tp2")
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
    assert a[-1]["loss"] < a[0]["loss"]
    # The fork really uses LayerNorm: its losses differ from Llama's.
    plain = [
        *TINY,
        "--training.steps",
        "8",
        "--training.global_batch_size",
        "8",
        "--training.local_batch_size",
        "8",
    ]
    run_train([*plain, "--job.dump_folder", str(tmp_path / "llama")], repo=repo, cwd=repo)
    assert abs(read_metrics(tmp_path / "llama")[-1]["loss"] - a[-1]["loss"]) > 1e-3
    # The export: LlamaForCausalLM has no norm biases, so the adapter's names lack them.
    convert = [sys.executable, str(repo / "scripts/convert_dcp_to_hf.py"), "--output", str(tmp_path / "hf")]
    checkpoint = ["--checkpoint", str(tmp_path / "fsdp2/checkpoint/step-8")]
    export = subprocess.run([*convert, *checkpoint], cwd=repo, capture_output=True, text=True)
    assert export.returncode == 2 and not (tmp_path / "hf").exists()
    assert export.stderr.splitlines() == [
        f"error: the model's parameter layers.0.attention_norm.bias has no Hugging Face name: add "
        f'"layers.{{}}.attention_norm.bias": "<its name in transformers>" to the names of '
        f"Llama3StateDictAdapter (models/{NAME}/state_dict_adapter.py), for a transformers architecture "
        "that has this weight (docs/forking.md, HF adapter)"
    ]


def test_guide_commands_match_the_steps():
    """The copy and registration lines quoted in docs/forking.md are the ones this test performs."""
    guide = (REPO / "docs/forking.md").read_text()
    assert "cp -r models/llama3 models/mymodel" in guide
    assert "sed -i 's/models\\.llama3/models.mymodel/g' models/mymodel/*.py" in guide
    assert '"mymodel": "models.mymodel",' in guide
