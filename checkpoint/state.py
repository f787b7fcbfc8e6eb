"""What a checkpoint holds, as one flat dictionary that torch.distributed.checkpoint (DCP) saves.

    model.<name>       every parameter under the full model's name (sharded DTensors are saved as
                       their shards and reassembled or resharded on load by DCP)
    optimizer.<...>    AdamW state and hyperparameters per parameter name (flattened)
    train              step, tokens seen, RNG states, the model's identity (plain Python object)
    dataloader         the global sample cursor (data/loader.py), identical on every rank

Names never contain the parallel layout (no stage, rank or wrapper prefixes), so a checkpoint
loads into any layout and any world size.
"""

import pickle
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from training.weight_init import original_name

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    model: str = ""  # "name flavor args": a checkpoint of another model is refused by name
    rng: bytes = b""  # pickled CPU (and CUDA) generator states

    def to_dict(self) -> dict:
        # Raw bytes, not pickled tensors: pickling a tensor is not byte-for-byte reproducible.
        generators = {"cpu": torch.get_rng_state().numpy().tobytes()}
        if torch.cuda.is_available():
            generators["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
        self.rng = pickle.dumps(generators)
        return asdict(self)

    def load_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        generators = pickle.loads(state["rng"]) if state["rng"] else {}
        as_tensor = lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if "cpu" in generators:
            torch.set_rng_state(as_tensor(generators["cpu"]))
        if "cuda" in generators and torch.cuda.is_available():
            torch.cuda.set_rng_state(as_tensor(generators["cuda"]))


def model_state(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters of every part this rank holds, under the full model's names."""
    merged = {}
    for part in model_parts:
        for name, tensor in get_model_state_dict(part).items():
            merged[original_name(name)] = tensor
    return merged


def load_model_state(model_parts: list[nn.Module], state: dict[str, torch.Tensor]) -> None:
    for part in model_parts:
        names = {original_name(name): name for name in get_model_state_dict(part)}
        set_model_state_dict(part, {names[n]: state[n] for n in names}, options=StateDictOptions(strict=True))


def optimizer_state(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    merged = {}
    for part, optimizer in zip(model_parts, optimizers):
        for key, value in get_optimizer_state_dict(part, optimizer, options=FLAT).items():
            merged[original_name(key)] = value
    return merged


def load_optimizer_state(
    model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], state: dict
) -> None:
    for part, optimizer in zip(model_parts, optimizers):
        keys = {original_name(key): key for key in get_optimizer_state_dict(part, optimizer, options=FLAT)}
        set_optimizer_state_dict(part, optimizer, {keys[k]: state[k] for k in keys}, options=FLAT)
