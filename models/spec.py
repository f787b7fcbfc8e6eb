"""What a model family hands to the rest of the repository: one ModelSpec per folder under models/."""

import dataclasses
import difflib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from configs import UserError
from configs.loader import parse_scalar


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    """Built as model_cls(args). It must provide init_weights() (random init from torch's global
    RNG, each module initializing its own subtree), init_buffers() and flops_per_token(seq_len)."""
    flavors: dict[str, Any]
    """Flavor name -> args dataclass, which must have the fields vocab_size and max_seq_len."""
    state_dict_adapter: Any = None
    """adapter(args): a models.hf_adapter.StateDictAdapter (Hugging Face names, layout, config.json)."""
    parallelize_plan: Callable | None = None
    """plan(model, tp_mesh, loss_parallel): applies the family's tensor-parallel plan in place."""
    tensor_parallel_sizes: Callable | None = None
    """sizes(args) -> {name: size} that the tensor-parallel degree must divide."""
    pipeline_split: Callable | None = None
    """split(args) -> (head, layers, tail) module names: modules that only the first stage holds,
    the layers spread over the stages in order, and modules that only the last stage holds."""


def model_args(
    spec: ModelSpec, flavor: str, seq_len: int, tokenizer_vocab_size: int, changes: list[str] = ()
) -> Any:
    """The flavor's args for this run: model.args changes applied, RoPE table of seq_len, vocabulary
    checked against the tokenizer."""
    args = _with_changes(spec.flavors[flavor], changes)
    vocab_size = args.vocab_size or -(-tokenizer_vocab_size // 64) * 64
    if tokenizer_vocab_size > vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but model {spec.name} {flavor} has a "
            f"vocabulary of {vocab_size}; use a matching model.hf_assets_path or flavor"
        )
    return dataclasses.replace(args, vocab_size=vocab_size, max_seq_len=seq_len)


def _with_changes(args: Any, changes: list[str]) -> Any:
    """Apply "name=value" strings (model.args) to an args dataclass, checking names and types."""
    hints = typing.get_type_hints(type(args))
    updates = {}
    for change in changes:
        name, has_value, raw = change.partition("=")
        name = name.strip()
        if not has_value or name not in hints:
            match = difflib.get_close_matches(name, list(hints), n=1)
            hint = f" (did you mean '{match[0]}'?)" if match else ""
            raise UserError(
                f"model.args: '{change}' is not name=value for a field of {type(args).__name__}{hint}"
            )
        updates[name] = parse_scalar(raw.strip(), hints[name], f"model.args {name}")
    return dataclasses.replace(args, **updates)
