"""What the conversion scripts share: the model a config describes, built on the meta device, and
DCP used in one process."""

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from configs import UserError, load_config
from configs.schema import JobConfig
from data.tokenizer import build_tokenizer
from models import check_flavor, get_model_spec
from models.spec import model_args


def load_run_config(config_path: str | None, checkpoint: Path | None) -> JobConfig:
    """--config, or the config.toml that train.py wrote next to the checkpoint's folder."""
    if config_path is None and checkpoint is not None:
        candidate = checkpoint.resolve().parent.parent / "config.toml"
        if not candidate.is_file():
            raise UserError(f"no config.toml next to {checkpoint}; name the run's config with --config")
        config_path = str(candidate)
    return load_config(["--config", config_path])


def build_meta_model(config: JobConfig):
    spec = get_model_spec(config.model.name)
    check_flavor(spec, config.model.flavor)
    vocab = build_tokenizer(config.model.hf_assets_path).vocab_size
    args = model_args(spec, config.model.flavor, config.training.seq_len, vocab, config.model.args)
    with torch.device("meta"):
        return spec, args, spec.model_cls(args)


@contextlib.contextmanager
def one_process_dcp() -> Iterator[None]:
    """DCP without a process group, on purpose: its warning that none exists would only alarm."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield
