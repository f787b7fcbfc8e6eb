"""The contract between a model family and the rest of the repository.

A family is a folder under models/ whose __init__.py defines `spec = ModelSpec(...)`, registered by
one line in models/__init__.py. parallelisms/, training/ and checkpoint/ rely on what this file
writes down and on nothing else of a model: the model class (`TrainableModel`), the few fields of
its args dataclass in ARGS_READ_OUTSIDE_MODELS, the names of the modules around its blocks (`head`,
`tail`), its tensor-parallel plan and its Hugging Face adapter (both optional), and its
Mixture-of-Experts layers, which are `models.moe.MoE` modules wherever they sit (found with
`models.moe.moe_layers(model)`; their args, buffers and load balancing are described there).
Every other name inside a family is its own (tests/test_model_contract.py trains a family that
shares no other name with the shipped ones).
"""

import dataclasses
import difflib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from configs import UserError
from configs.loader import parse_scalar
from models.moe import MOE_OPTIONS

# The fields of a family's args dataclass that code outside models/ reads, and what for; every
# other field is the family's own. A family whose args lack a required one is refused by name.
ARGS_READ_OUTSIDE_MODELS = {
    "vocab_size": "the vocabulary size; 0 = the tokenizer's, rounded up to a multiple of 64 (model_args)",
    "max_seq_len": "set to training.seq_len for each run (model_args); it may change on resume",
    "dim": "the hidden size: the memory estimate's block inputs (training/memory_estimate.py)",
    "ffn_hidden_dim": "the feed-forward width of a block without a models.moe.MoE layer, for the memory "
    "estimate; a family whose blocks all have one need not define it",
    "mtp_depth": "multi-token prediction's depth: the data loader reads that many tokens more per sample "
    "and the training step passes them (TrainableModel.forward's mtp_tokens); absent = 0",
    "mtp_loss_weight": "the weight of the MTP depths' mean loss in the objective (training/loss.py)",
}
REQUIRED_ARGS = ("vocab_size", "max_seq_len", "dim")


class TrainableModel(Protocol):
    """What `spec.model_cls(args)` builds (plain PyTorch, no distributed code).

    The args are a dataclass with the fields of ARGS_READ_OUTSIDE_MODELS; its __post_init__ raises
    ValueError for shapes that cannot build a model (a run reports it as one error line before
    anything is built or written).
    """

    layers: nn.ModuleDict
    """The repeated blocks, keyed "0", "1", ...: FSDP shards each one, activation checkpointing and
    torch.compile wrap each one, pipeline stages keep some of them by key, so parameter names
    (`layers.7.attention.wq.weight`) are the same on every layout."""

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_mask: Any = None
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab). A pipeline stage sets the head or tail
        modules it does not hold to None: without the head, forward takes hidden states instead
        of tokens; without the tail it returns hidden states. attention_mask (None = causal) goes,
        untouched, to every models.attention.CausalAttentionKernel (or LatentAttentionKernel): that
        is how document masking (`model.attention_mask = "document"`) and context parallelism reach
        a model.

        A family with multi-token prediction (multi_token_prediction(args) depth D > 0) also takes
        `mtp_tokens` (batch, D, seq), row d - 1 the tokens d positions ahead of `tokens`, when
        training; given them, it returns a tuple: the main logits, then each depth's."""
        ...

    def init_weights(self) -> None:
        """Random init from torch's global RNG, each module initializing its own subtree; every
        module's init_weights() that the weight init may call takes no arguments (it runs on a
        meta-device copy with one real parameter at a time, seeded by that parameter's name)."""
        ...

    def init_buffers(self, positions: torch.Tensor | None = None) -> None:
        """Fill non-parameter tensors (RoPE tables) after materialization; positions are the
        sequence positions this rank holds (context parallelism), default all."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, for TFLOP/s and MFU."""
        ...


@dataclass(frozen=True)
class TensorParallelPlan:
    """torch's parallel styles by module name: `root` for modules outside the blocks (names in the
    full model), `block` for modules inside every block of `layers` (names within a block)."""

    root: dict[str, ParallelStyle]
    block: dict[str, ParallelStyle]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    """Built as model_cls(args); provides what TrainableModel describes."""
    flavors: dict[str, Any]
    """Flavor name -> args dataclass."""
    head: tuple[str, ...]
    """Modules that run before the blocks (the embedding): only the first pipeline stage holds them."""
    tail: tuple[str, ...]
    """Modules that run after the blocks (final norm, output projection): only the last stage holds
    them (the memory estimate counts the logits' memory on the rank that does)."""
    state_dict_adapter: Any = None
    """adapter(args): a models.hf_adapter.StateDictAdapter (Hugging Face names, layout, config.json);
    None: no Hugging Face import or export for this family."""
    tensor_parallel_plan: Callable[[Any, bool], TensorParallelPlan] | None = None
    """plan(args, loss_parallel): how tensor parallelism splits the model (None: not supported).
    With loss_parallel the output projection must leave the logits sharded over the vocabulary."""
    tensor_parallel_sizes: Callable[[Any], dict[str, int]] | None = None
    """sizes(args) -> {what: size} that the tensor-parallel degree must divide."""
    last_stage: Callable[[Any], tuple[str, ...]] = lambda args: ()
    """last_stage(args): modules besides `tail` that the last pipeline stage holds: blocks of
    `layers` that run on the tail's input (DeepSeek-V3's multi-token prediction, "layers.61"),
    and head modules the tail reads too (its embedding): the first stage keeps those as well, and
    the two copies' gradients are summed every step, so that one update keeps them equal. Such a
    stage gets hidden states, not tokens, though it holds the embedding: its model tells them
    apart by dtype."""

    def adapter(self, args: Any) -> Any:
        """The Hugging Face adapter for these args, or None if the family has none."""
        return self.state_dict_adapter(args) if self.state_dict_adapter is not None else None


def multi_token_prediction(args: Any) -> tuple[int, float]:
    """(depth, loss weight) of a family's multi-token prediction: its args' mtp_depth and
    mtp_loss_weight, (0, 0.0) for a family without them."""
    return getattr(args, "mtp_depth", 0), getattr(args, "mtp_loss_weight", 0.0)


def model_args(
    spec: ModelSpec, flavor: str, seq_len: int, tokenizer_vocab_size: int, changes: list[str] = ()
) -> Any:
    """The flavor's args for this run: model.args changes applied, RoPE table of seq_len, vocabulary
    checked against the tokenizer."""
    missing = [name for name in REQUIRED_ARGS if not hasattr(spec.flavors[flavor], name)]
    if missing:
        raise UserError(
            f"model {spec.name}: its args ({type(spec.flavors[flavor]).__name__}) have no "
            f"{', '.join(missing)}, which code outside models/ reads (models/spec.py, "
            "ARGS_READ_OUTSIDE_MODELS)"
        )
    try:  # the args dataclass refuses impossible shapes in __post_init__ (ValueError)
        args = _with_changes(spec.flavors[flavor], changes)
        vocab_size = args.vocab_size or -(-tokenizer_vocab_size // 64) * 64
        args = dataclasses.replace(args, vocab_size=vocab_size, max_seq_len=seq_len)
    except ValueError as e:
        raise UserError(f"model {spec.name} {flavor} (model.args {list(changes)}): {e}") from None
    if tokenizer_vocab_size > vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but model {spec.name} {flavor} has a "
            f"vocabulary of {vocab_size}; use a matching model.hf_assets_path or flavor"
        )
    return args


def _with_changes(args: Any, changes: list[str]) -> Any:
    """Apply "name=value" strings (model.args) to an args dataclass, checking names and types."""
    hints = typing.get_type_hints(type(args))
    updates = {}
    for change in changes:
        name, has_value, raw = change.partition("=")
        name = name.strip()
        has_experts = any(option in hints for option in MOE_OPTIONS)
        if has_value and name in MOE_OPTIONS and not has_experts:
            raise UserError(
                f"model.args: '{name}' is a Mixture-of-Experts option and {type(args).__name__} has no "
                "experts (choose a model.name with experts, e.g. qwen3_moe)"
            )
        if not has_value or name not in hints:
            match = difflib.get_close_matches(name, list(hints), n=1)
            hint = f" (did you mean '{match[0]}'?)" if match else ""
            raise UserError(
                f"model.args: '{change}' is not name=value for a field of {type(args).__name__}{hint}"
            )
        updates[name] = parse_scalar(raw.strip(), hints[name], f"model.args {name}")
    return dataclasses.replace(args, **updates)
