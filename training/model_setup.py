"""The model a config names, checked against the parallel layout before anything is built.

train.py and the dry run (training/dry_run.py) both start here, so a config that one accepts the
other accepts too.
"""

from typing import Any

from configs.schema import JobConfig
from data.tokenizer import Tokenizer, build_tokenizer
from models import check_flavor, get_model_spec
from models.spec import ModelSpec, model_args
from parallelisms import ParallelDims
from parallelisms.pipeline import check_schedule


def resolve_model(config: JobConfig, dims: ParallelDims) -> tuple[ModelSpec, Tokenizer, Any]:
    """The model's spec, the tokenizer and the model args, after the checks that need no model:
    flavor, sequence split (CP, TP), sizes that TP must divide, the pipeline schedule."""
    spec = get_model_spec(config.model.name)
    check_flavor(spec, config.model.flavor)
    tokenizer = build_tokenizer(config.model.hf_assets_path)
    args = model_args(
        spec, config.model.flavor, config.training.seq_len, tokenizer.vocab_size, config.model.args
    )
    dims.check_sequence_split(config.training.seq_len)
    if dims.tp_enabled:
        dims.check_divisibility(spec.tensor_parallel_sizes(args))
    if dims.pp_enabled:
        check_schedule(config.parallelism, dims.fsdp_enabled)
    return spec, tokenizer, args
