"""Hugging Face import and export: conversion scripts, initial weights, logits equal to transformers."""

import contextlib
import functools
import io
import json
import logging
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from conftest import REPO, TINY, read_metrics, run_train
from test_bad_inputs import run_catalog
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

from checkpoint import hf
from configs import load_config
from models import get_model_spec
from models.spec import model_args
from parallelisms import ParallelDims
from parallelisms.wrapper_names import original_name
from scripts import convert_dcp_to_hf, convert_hf_to_dcp
from scripts.model_from_config import one_process_dcp
from training.model_setup import build_model, resolve_model
from training.weight_init import init_weights, materialize

EXPORT_CONFIGS = ("config.json", "generation_config.json")
COMMON = [*TINY, "--training.steps", "5", "--training.global_batch_size", "8"]


def script(name: str, *args: str) -> None:
    """Run a script to success, quietly: no warnings on stderr either."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True
    )
    assert result.returncode == 0 and not result.stderr, result.stdout + result.stderr


def read_model(checkpoint: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {name: torch.empty_like(t) for name, t in like.items()}
    with one_process_dcp():
        dcp.load(
            {"model": state},
            checkpoint_id=str(checkpoint),
            planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
        )
    return state


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 5-step run with its checkpoint, and its export to Hugging Face files."""
    folder = tmp_path_factory.mktemp("trained")
    run_train(
        [*COMMON, "--training.local_batch_size", "8", "--checkpoint.enable", "--job.dump_folder", str(folder)]
    )
    step = str(folder / "checkpoint/step-5")
    script("convert_dcp_to_hf.py", "--checkpoint", step, "--output", str(folder / "hf"), "--dtype", "float32")
    return folder


def tiny_state() -> dict[str, torch.Tensor]:
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(model_args(spec, "tiny", 32, 258))
    return {name: torch.empty(p.shape) for name, p in model.named_parameters()}


@pytest.mark.slow
def test_export_then_import_gives_back_the_same_weights(trained, tmp_path):
    hf_folder = trained / "hf"
    assert (hf_folder / "model.safetensors.index.json").is_file()
    config, generation = (json.loads((hf_folder / name).read_text()) for name in EXPORT_CONFIGS)
    assert config["bos_token_id"] == generation["bos_token_id"] == 256  # the byte tokenizer's
    assert config["eos_token_id"] == generation["eos_token_id"] == 257
    file_mode = hf_folder.stat().st_mode & 0o666
    assert {p.name: p.stat().st_mode & 0o777 for p in hf_folder.iterdir()} == dict.fromkeys(
        [p.name for p in hf_folder.iterdir()], file_mode
    )
    script("convert_hf_to_dcp.py", "--hf", str(hf_folder), "--config", str(trained / "config.toml"),
           "--output", str(tmp_path / "dcp"))  # fmt: skip
    assert (tmp_path / "dcp" / "checksums.json").is_file()  # loads verified, like a training save
    original = read_model(trained / "checkpoint/step-5", tiny_state())
    round_trip = read_model(tmp_path / "dcp", tiny_state())
    for name in original:
        assert torch.equal(original[name], round_trip[name]), name


@pytest.mark.slow
def test_training_starts_from_hf_weights_on_any_layout(trained, tmp_path):
    losses = {}
    for name, nproc, local in [("single", None, "8"), ("fsdp2", 2, "4")]:
        folder = tmp_path / name
        weights = ["--checkpoint.initial_load_path", str(trained / "hf")]
        run_train(
            [*COMMON, "--training.local_batch_size", local, *weights, "--job.dump_folder", str(folder)],
            nproc=nproc,
        )
        losses[name] = read_metrics(folder)[0]["loss"]
    scratch = read_metrics(trained)[0]["loss"]
    assert losses["fsdp2"] == pytest.approx(losses["single"], rel=1e-6)
    assert losses["single"] < scratch - 0.1  # the trained weights, not a fresh init


SAFE_OPEN = hf.safe_open


class CountedSlice:
    """A tensor's slice in a safetensors file, counting the elements read through it."""

    def __init__(self, inner, name: str, counts: Counter):
        self.inner, self.name, self.counts = inner, name, counts

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, box):
        values = self.inner[box]
        self.counts[self.name] += values.numel()
        return values


@contextlib.contextmanager
def counting_safe_open(counts: Counter, file: str, framework: str):
    """safe_open whose reads add up, per Hugging Face tensor name, in counts."""
    with SAFE_OPEN(file, framework=framework) as opened:
        yield SimpleNamespace(
            keys=opened.keys, get_slice=lambda name: CountedSlice(opened.get_slice(name), name, counts)
        )


def seeded_model(args, spec):
    with torch.device("meta"):
        model, template = spec.model_cls(args), spec.model_cls(args)
    materialize(model, torch.device("cpu"))
    init_weights(model, template, seed=7)
    return model


@pytest.mark.filterwarnings("ignore:Parallelize plan key")  # a stage lacks the others' modules
def test_each_rank_reads_only_its_shard(tmp_path, monkeypatch):
    """PP 2 x FSDP 3 x TP 2, simulated rank by rank: uneven FSDP chunks cut heads of wk, whose rows
    Llama's adapter permutes within each head. Every rank gets the full import's values and reads
    only its stage's tensors, only its box of each (whole heads for q/k)."""
    degrees = {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 3, "tensor_parallel_degree": 2}
    overrides = [f"--parallelism.{key}={value}" for key, value in degrees.items()]
    config = load_config(["--config", str(REPO / "configs/llama3_debug.toml"), *TINY, *overrides])
    spec = get_model_spec("llama3")
    dims = ParallelDims.from_config(config.parallelism, 12)
    _, _, args = resolve_model(config, dims)
    full = {name: p.detach() for name, p in seeded_model(args, spec).named_parameters()}
    adapter = spec.state_dict_adapter(args)
    hf.save(full, adapter, tmp_path / "hf", torch.float32, hf_assets_path="")
    head_dim = args.dim // args.n_heads
    stage_names = set()
    for rank in range(12):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=12)
        # DTensor caches sharding decisions by mesh, and the meshes of two simulated ranks compare equal.
        _clear_sharding_prop_cache()
        try:
            mesh = dims.build_mesh("cpu")
            parts = build_model(config, dims, mesh, torch.device("cpu"), initialize=False).parts
            for part in parts:
                materialize(part, torch.device("cpu"))
            reads = Counter()
            monkeypatch.setattr(hf, "safe_open", functools.partial(counting_safe_open, reads))
            hf.load_into(parts, adapter, tmp_path / "hf")
            params = {original_name(n): p for part in parts for n, p in part.named_parameters()}
            stage_names.update(params)
            for name, param in params.items():
                local = param.to_local()
                want = distribute_tensor(full[name], param.device_mesh, param.placements, src_data_rank=None)
                assert torch.equal(local, want.to_local()), (rank, name)
                budget = local.numel()
                if name.endswith(("wq.weight", "wk.weight")):  # whole heads around its rows
                    budget = (local.shape[0] + 2 * (head_dim - 1)) * local.shape[1]
                assert local.numel() <= reads[adapter.to_hf_name(name)] <= budget, (rank, name)
            assert set(reads) <= {adapter.to_hf_name(n) for n in params}  # nothing of other stages'
            assert all(isinstance(p, DTensor) for p in params.values())
        finally:
            dist.destroy_process_group()
    assert stage_names == set(full)


def test_conversion_errors(trained, tmp_path):
    """Each mistake ends in one error line and exit code 2, writing nothing (main() in this process:
    no interpreter to start; the scripts' own runs above show them quiet)."""
    out, config = tmp_path / "out", str(trained / "config.toml")
    other = tmp_path / "debug.toml"
    other.write_text('[model]\nflavor = "debugmodel"\n')
    to_dcp = lambda folder, config: ["--hf", str(folder), "--config", config, "--output", str(out)]
    to_hf = ["--checkpoint", str(trained / "checkpoint/step-5"), "--output", str(trained / "hf")]
    truncated = truncated_copy(trained / "hf", tmp_path)
    cases = [
        (convert_dcp_to_hf, to_hf, "already exists"),
        (convert_hf_to_dcp, to_dcp(tmp_path, config), "holds no .safetensors files"),
        (convert_hf_to_dcp, to_dcp(trained / "hf", str(other)), "but the model's"),
        (convert_hf_to_dcp, to_dcp(truncated, config), "cannot be read as safetensors"),
    ]
    for module, args, expected in cases:
        code, stderr = run_script_main(module, *args)
        assert code == 2 and stderr.startswith("error: ") and expected in stderr, stderr
        assert stderr.count("\n") == 1 and not out.exists()


def truncated_copy(hf_folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "truncated"
    shutil.copytree(hf_folder, copy)
    shard = next(copy.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1000])
    return copy


def run_script_main(module, *args: str) -> tuple[int, str]:
    """A script's main() in this process (no interpreter start): exit code and stderr."""
    stderr = io.StringIO()
    with mock.patch.object(sys, "argv", [module.__file__, *args]), contextlib.redirect_stderr(stderr):
        code = module.main()
    return code, stderr.getvalue()


def test_unusable_initial_weights_stop_with_one_error_line(trained, tmp_path):
    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "notes.txt").write_text("not weights")
    cases = [
        (truncated_copy(trained / "hf", tmp_path), "cannot be read as safetensors (truncated or damaged?)"),
        (neither, "is neither a checkpoint (a step-N folder with .metadata) nor a Hugging Face folder"),
        (trained, f"it holds checkpoints: name one, e.g. {trained / 'checkpoint' / 'step-5'}"),
    ]
    argvs = [
        [*COMMON, "--job.dump_folder", str(tmp_path / f"run{i}"), "--checkpoint.initial_load_path", str(path)]
        for i, (path, _) in enumerate(cases)
    ]
    for (_, expected), result in zip(cases, run_catalog(argvs, tmp_path)):
        errors = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
        assert result["code"] == 2 and len(errors) == 1 and expected in errors[0], result["stderr"][-2000:]
        assert "Traceback" not in result["stderr"]


@contextlib.contextmanager
def no_warnings_from_transformers():
    """Fails if transformers logs a warning or anything raises a Python warning inside."""
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(handler)
    assert not logged and not raised, [r.getMessage() for r in logged] + [str(w.message) for w in raised]


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers(family, tied, tmp_path):
    spec = get_model_spec(family)
    args = model_args(spec, "tiny", 64, 258, [f"tie_embeddings={str(tied).lower()}"])
    model = seeded_model(args, spec)
    model.init_buffers()
    state = {name: p.detach() for name, p in model.named_parameters()}
    for name, tensor in state.items():
        if ".moe." in name:  # sharper routing, larger expert outputs: wrong routing would show
            tensor.mul_(5)
    hf.save(state, spec.state_dict_adapter(args), tmp_path / "hf", torch.float32, hf_assets_path="")
    with no_warnings_from_transformers():  # e.g. none about the RoPE scaling keys of config.json
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    names = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    assert type(theirs).__name__ == names[family]
    theirs.eval()
    tokens = torch.randint(0, 258, (2, 64))
    with torch.no_grad():
        ours, reference = model(tokens), theirs(tokens).logits
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def word_tokenizer(folder: Path) -> Path:
    """A tokenizer.json of seven words, BOS and EOS (ids 1 and 2, not the byte tokenizer's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_export_generates_until_the_tokenizers_eos(tmp_path):
    assets = word_tokenizer(tmp_path / "assets")
    spec = get_model_spec("llama3")
    args = model_args(spec, "tiny", 32, 8)
    state = {name: p.detach().clone() for name, p in seeded_model(args, spec).named_parameters()}
    # A model that always predicts EOS (id 2): blocks add nothing to the residual stream, every token
    # embeds to ones, and only EOS's output row is not orthogonal to the normalized ones.
    state["tok_embeddings.weight"].fill_(1.0)
    for name, tensor in state.items():
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            tensor.zero_()
    state["output.weight"].zero_()
    state["output.weight"][2] = 1.0
    hf.save(state, spec.state_dict_adapter(args), tmp_path / "hf", torch.float32, str(assets))
    config, generation = (json.loads((tmp_path / "hf" / name).read_text()) for name in EXPORT_CONFIGS)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    transformers.utils.logging.disable_progress_bar()
    with no_warnings_from_transformers():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))  # the copied files
        prompt = tokenizer("the cat sat", return_tensors="pt").input_ids
        generated = model.generate(prompt, max_new_tokens=8)
    assert prompt.tolist() == [[3, 4, 5]]
    assert generated.tolist() == [[3, 4, 5, 2]]  # one EOS, then stopped (not eight of them)
