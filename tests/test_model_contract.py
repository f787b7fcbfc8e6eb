"""models/spec.py is the whole contract: a family written from scratch to it, with internal names of
its own (no Llama module or field names beyond those spec.py asks for, no tensor-parallel plan, no
Hugging Face adapter), goes through the dry run, the memory estimate and training as the shipped
families do."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, TINY, read_metrics, run_train

from models.spec import ARGS_READ_OUTSIDE_MODELS
from training.memory_estimate import ACTIVATION_BYTES_PER_FFN

MINIMAL_MODEL = '''
"""A minimal decoder written to models/spec.py only: NoPE attention and an MLP per block."""

from dataclasses import dataclass

import torch
from torch import nn

from models.attention import CausalAttentionKernel
from models.spec import ModelSpec


@dataclass
class MinimalArgs:
    dim: int = 64  # the contract's field names (models/spec.py) ...
    ffn_hidden_dim: int = 96
    vocab_size: int = 0
    max_seq_len: int = 64
    depth: int = 3  # ... and the family's own
    heads: int = 4


class Mixer(nn.Module):
    def __init__(self, args: MinimalArgs):
        super().__init__()
        self.heads = args.heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim, bias=False)
        self.kernel = CausalAttentionKernel()

    def forward(self, x, attention_mask=None):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(self.kernel(q, k, v, attention_mask).transpose(1, 2).reshape(batch, seq, dim))


class Cell(nn.Module):
    def __init__(self, args: MinimalArgs):
        super().__init__()
        self.pre_mix, self.pre_mlp = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.mix = Mixer(args)
        width = args.ffn_hidden_dim
        self.mlp = nn.Sequential(nn.Linear(args.dim, width), nn.GELU(), nn.Linear(width, args.dim))

    def forward(self, x, attention_mask=None):
        x = x + self.mix(self.pre_mix(x), attention_mask)
        return x + self.mlp(self.pre_mlp(x))


class MinimalDecoder(nn.Module):
    def __init__(self, args: MinimalArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Cell(args) for i in range(args.depth)})
        self.final_norm = nn.LayerNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens, positions=None, attention_mask=None):
        x = self.embed(tokens) if self.embed is not None else tokens
        for cell in self.layers.values():
            x = cell(x, attention_mask)
        if self.final_norm is None:
            return x
        return self.lm_head(self.final_norm(x))

    def init_weights(self):
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def init_buffers(self, positions=None):
        pass  # no position tables: causal attention alone orders the tokens

    def flops_per_token(self, seq_len: int) -> float:
        body = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("embed."))
        return 6 * body + 6 * self.args.depth * seq_len * self.args.dim


spec = ModelSpec(
    name="minimal",
    model_cls=MinimalDecoder,
    flavors={"tiny": MinimalArgs()},
    head=("embed",),
    tail=("final_norm", "lm_head"),
)
'''


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """A copy of this repository with the minimal family registered (one line in models/__init__.py)."""
    repo = tmp_path_factory.mktemp("fork") / "repo"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(".git", "outputs", "__pycache__", ".whl"))
    (repo / "models/minimal").mkdir()
    (repo / "models/minimal/__init__.py").write_text(MINIMAL_MODEL)
    registry = repo / "models/__init__.py"
    line = '    "llama3": "models.llama3",\n'
    registry.write_text(registry.read_text().replace(line, line + '    "minimal": "models.minimal",\n'))
    return repo


MINIMAL = [*TINY, "--model.name", "minimal"]


@pytest.mark.slow
def test_a_family_written_to_the_contract_dry_runs_estimates_and_trains(repository, tmp_path):
    dry = run_train(
        [*MINIMAL, "--job.dry_run", "--job.dry_run_world_size", "4"], repo=repository, cwd=repository
    )
    assert "dry run of minimal tiny" in dry.stdout and "estimated memory per rank" in dry.stdout, dry.stdout

    # Enough tokens that the estimate's activations show in two decimals of a GiB: per token each of
    # the 3 blocks by its feed-forward width, and the logits (vocabulary 320: the byte tokenizer's 258
    # rounded up), because rank 0 holds the tail, a module named as this family names it (lm_head).
    batch, seq = 64, 4096
    command = [sys.executable, "scripts/estimate_memory.py", "--world-size", "2", "--", *MINIMAL,
               "--training.local_batch_size", str(batch), "--training.seq_len", str(seq)]  # fmt: skip
    estimate = subprocess.run(command, cwd=repository, capture_output=True, text=True, check=True)
    memory = json.loads(estimate.stdout.strip().splitlines()[-1])
    per_token = 3 * ACTIVATION_BYTES_PER_FFN * 96 + 6 * 320
    assert memory["activations_gib"] == pytest.approx(per_token * batch * seq / 2**30, abs=0.006), memory

    folder = tmp_path / "trained"
    run_train(
        [*MINIMAL, "--training.steps", "2", "--job.dump_folder", str(folder)], repo=repository, cwd=repository
    )
    records = read_metrics(folder)
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)


def test_a_family_without_a_contract_field_is_refused_by_name(repository, tmp_path):
    """Args named otherwise (here `width` for `dim`): one error line naming the field, not a crash."""
    renamed = repository.parent / "renamed"
    shutil.copytree(repository, renamed)
    package = renamed / "models/minimal/__init__.py"
    package.write_text(
        package.read_text().replace("dim: int = 64", "width: int = 64").replace("args.dim", "args.width")
    )
    result = run_train([*MINIMAL, "--job.dump_folder", str(tmp_path)], repo=renamed, cwd=renamed, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: model minimal: its args (MinimalArgs) have no dim, which code outside models/ reads "
        "(models/spec.py, ARGS_READ_OUTSIDE_MODELS)"
    )


def test_every_args_field_read_outside_models_is_in_the_contract():
    """A field of a family's args read by training/, parallelisms/, checkpoint/ or data/ (as
    `args.<field>`; an MoE layer's own `moe.args` is models/moe.py's) is written down in spec.py."""
    read = set()
    for folder in ("training", "parallelisms", "checkpoint", "data"):
        for path in (REPO / folder).rglob("*.py"):
            read |= set(re.findall(r"(?<![\w.])args\.(\w+)", path.read_text()))
    assert read and read <= set(ARGS_READ_OUTSIDE_MODELS), read - set(ARGS_READ_OUTSIDE_MODELS)
