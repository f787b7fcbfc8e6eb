"""Config parsing, overrides, errors, the resolved-config dump and the config reference page."""

import dataclasses
import json
import subprocess
import sys

import pytest
from conftest import REPO, TINY, run_train

from configs import JobConfig, UserError, config_to_toml, load_config
from configs.docs import BEGIN, END, PAGE, configuration_page, field_docs, reference_markdown
from models import check_flavor, get_model_spec

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def write(tmp_path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file():
    assert load_config([]) == JobConfig()


def test_toml_then_cli_overrides_in_both_forms(tmp_path):
    file = write(
        tmp_path, '[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n[model]\nflavor = "tiny"\n'
    )
    config = load_config(["--config", file, "--training.steps", "9", "--optimizer.eps=1e-6"])
    assert config.training.steps == 9  # CLI wins over the file
    assert config.training.seq_len == 64  # file wins over the default
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)  # int accepted as float
    assert config.optimizer.eps == 1e-6
    assert config.model.flavor == "tiny"
    assert load_config([f"--config={file}"]).training.steps == 7


@pytest.mark.parametrize(
    "argv, value",
    [
        (["--metrics.enable_tensorboard", "false"], False),
        (["--metrics.enable_tensorboard=off"], False),
        (["--metrics.enable_tensorboard", "--training.steps", "3"], True),  # bare flag
        (["--metrics.enable_tensorboard"], True),
    ],
)
def test_boolean_overrides(argv, value):
    config = load_config(["--metrics.enable_tensorboard=false", *argv]) if value else load_config(argv)
    assert config.metrics.enable_tensorboard is value


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stpes", "3"], "unknown key 'training.stpes' (did you mean 'training.steps'?)"),
        (["--trainig.steps", "3"], "did you mean 'training.steps'?"),
        (["--training.steps", "three"], "training.steps must be an integer, got 'three'"),
        (["--training.steps", "2.5"], "training.steps must be an integer"),
        (["--optimizer.lr", "fast"], "optimizer.lr must be a number"),
        (["--training.device", "gpu"], "training.device must be one of 'auto', 'cuda', 'cpu', got 'gpu'"),
        (["--lr_scheduler.decay_type", "cosin"], "(did you mean 'cosine'?)"),
        (["--training.steps", "0"], "training.steps must be >= 1 (got 0)"),
        (["--training.local_batch_size=-2"], "training.local_batch_size must be >= 1"),
        (["--optimizer.lr", "-1"], "optimizer.lr must be a positive number"),
        (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio must be in (0, 1]"),
        (["--training.dataset", "text"], "training.dataset_path is required when training.dataset = 'text'"),
        (["--metrics.enable_tensorboard", "maybe"], "metrics.enable_tensorboard must be true or false"),
        (["--training.steps"], "--training.steps needs a value"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--config", "/nonexistent/x.toml"], "config file '/nonexistent/x.toml' does not exist"),
    ],
)
def test_command_line_errors_name_the_key(argv, message):
    with pytest.raises(UserError) as error:
        load_config(argv)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[trainig]\nsteps = 3\n", "unknown section [trainig] in"),
        ("[training]\nsteps = '3'\n", "training.steps must be an integer, got '3'"),
        ("[training]\nstep = 3\n", "unknown key 'training.step' (did you mean 'training.steps'?)"),
        ("[metrics]\nenable_tensorboard = 1\n", "metrics.enable_tensorboard must be true or false"),
        ("training = 3\n", "'training' in"),
        ("[training\n", "is not valid TOML"),
    ],
)
def test_file_errors_name_the_key(tmp_path, text, message):
    with pytest.raises(UserError) as error:
        load_config(["--config", write(tmp_path, text)])
    assert message in str(error.value)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(
        ["--training.steps", "11", "--job.description", 'a "quoted" \\ text', "--optimizer.eps=1e-12"]
    )
    text = config_to_toml(config)
    assert load_config(["--config", write(tmp_path, text)]) == config
    assert tomllib.loads(text)["training"]["steps"] == 11


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_shipped_configs_load(name):
    """Every recipe loads with each key it sets in effect, names a registered model flavor, and sets
    its global batch (left at -1 it would grow with the number of ranks, and the loss curve with it)."""
    path = REPO / "configs" / name
    config = load_config(["--config", str(path)])
    written = tomllib.loads(path.read_text())
    assert written, f"{name} sets nothing"
    for section, keys in written.items():
        for key, value in keys.items():
            assert getattr(getattr(config, section), key) == value, f"{name}: [{section}] {key}"
    check_flavor(get_model_spec(config.model.name), config.model.flavor)
    global_batch = written["training"].get("global_batch_size", -1)
    assert global_batch > 0 and global_batch % config.training.local_batch_size == 0, (
        f"{name}: set [training] global_batch_size, a multiple of local_batch_size"
    )


def test_every_key_is_documented():
    for section in dataclasses.fields(JobConfig):
        docs = field_docs(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            assert docs.get(f.name, "").strip(), (
                f"[{section.name}] {f.name} has no docstring in configs/schema.py"
            )


def test_config_reference_is_current():
    """docs/configuration.md is what configs/docs.py renders from the schema's docstrings."""
    page = PAGE.read_text() if PAGE.exists() else ""
    tables = page.partition(BEGIN)[2].partition(END)[0]
    assert tables.strip() == reference_markdown().strip(), "stale tables: python -m configs.docs --write"
    assert page == configuration_page(), "stale page: python -m configs.docs --write"


def launch_train_py(argv: list[str], cwd) -> tuple[int, str, str, bool]:
    """`python train.py ARGV`, reporting (exit code, stdout, stderr, whether torch was imported)."""
    script = ("import json, runpy, sys\n"
              f"sys.argv = ['train.py', *{argv!r}]; sys.path.insert(0, {str(REPO)!r})\n"
              "try:\n"
              f"    runpy.run_path({str(REPO / 'train.py')!r}, run_name='__main__')\n"
              "except SystemExit as e:\n"
              "    print(json.dumps([e.code, 'torch' in sys.modules]))\n")  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    code, imported_torch = json.loads(result.stdout.strip().splitlines()[-1])
    return code, result.stdout, result.stderr, imported_torch


def test_help_missing_config_and_config_mistakes_answer_before_torch_is_imported(tmp_path):
    code, out, err, torch_imported = launch_train_py(["--help"], tmp_path)
    assert code == 0 and "--section.key VALUE" in out and "docs/configuration.md" in out
    assert not torch_imported
    code, out, err, torch_imported = launch_train_py([], tmp_path)
    assert code == 2 and err.strip().splitlines() == [
        "error: no --config given: name a recipe, e.g. python train.py --config configs/llama3_debug.toml "
        "(python train.py --help shows how)"
    ]
    code, out, err, torch_imported = launch_train_py([*TINY, "--training.stpes", "3"], tmp_path)
    assert code == 2 and not torch_imported
    assert err.strip().splitlines() == [
        "error: unknown key 'training.stpes' (did you mean 'training.steps'?)"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_train_writes_the_resolved_config(tmp_path):
    run_train([*TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path), "--optimizer.lr=0.002"])
    written = load_config(["--config", str(tmp_path / "config.toml")])
    assert written.optimizer.lr == 0.002 and written.model.flavor == "tiny"
    assert written.job.dump_folder == str(tmp_path)
