"""What a checkpoint holds, as one flat dictionary that torch.distributed.checkpoint (DCP) saves.

    model.<name>       every parameter under the full model's name (sharded DTensors are saved as
                       their shards and reassembled or resharded on load by DCP)
    optimizer.<...>    the optimizer's state and settings per parameter name (flattened)
    train              step, tokens seen, RNG states, the model's identity (plain Python object)
    dataloader         the global sample cursor (data/loader.py), identical on every rank

Names never contain the parallel layout (no stage, rank or wrapper prefixes), so a checkpoint
loads into any layout and any world size.
"""

import json
import logging
import pickle
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpoint.data_only import plain_loads
from configs import UserError

logger = logging.getLogger(__name__)
# torch's state-dict helpers already name parameters as the plain model does (no wrapper
# prefixes); a rank holding several parts (pipeline stages) merges them.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# Args that may change on resume: the RoPE table follows training.seq_len.
RESUMABLE_ARGS = ("max_seq_len",)
PARTS = ("model", "optimizer", "train", "dataloader")
# Optimizer settings that follow the lr schedule, not the config: not reported as changed on resume.
SCHEDULED = ("lr", "initial_lr")


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    model: str = ""  # the model's identity (describe()): a checkpoint of another model is refused
    rng: bytes = b""  # pickled {"cpu": bytes, "cuda": bytes}: builtins only, read by plain_loads

    @staticmethod
    def describe(name: str, args: Any) -> str:
        """The family and every architecture argument, as JSON."""
        described = {f.name: getattr(args, f.name) for f in fields(args)} if is_dataclass(args) else {}
        return json.dumps({"name": name, **described}, sort_keys=True)

    def to_dict(self) -> dict:
        # Raw bytes, not pickled tensors: pickling a tensor is not byte-for-byte reproducible.
        generators = {"cpu": torch.get_rng_state().numpy().tobytes()}
        if torch.cuda.is_available():
            generators["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
        self.rng = pickle.dumps(generators)
        return asdict(self)

    def check_model(self, saved: str, where: str, allow_change: bool = False) -> None:
        """Refuse a checkpoint whose model differs from this run's in any architecture argument
        (tensor shapes alone miss e.g. n_heads or rope_theta); allow_change: warn instead."""
        try:
            theirs, ours = json.loads(saved), json.loads(self.model)
        except json.JSONDecodeError:
            return  # written before the identity was recorded: shapes are checked on their own
        differences = [
            f"{key} {theirs.get(key)!r} there, {ours.get(key)!r} here"
            for key in sorted(set(theirs) | set(ours))
            if key not in RESUMABLE_ARGS and theirs.get(key) != ours.get(key)
        ]
        if differences and allow_change:
            logger.warning(
                f"checkpoint {where} holds another model ({'; '.join(differences)}); loading it as "
                "checkpoint.allow_model_change asks"
            )
        elif differences:
            raise UserError(
                f"checkpoint {where} holds another model ({'; '.join(differences)}); to load it into this "
                "model on purpose set checkpoint.allow_model_change (shapes must match), or start from its "
                "weights with checkpoint.initial_load_path"
            )

    def load_dict(self, state: dict) -> None:
        """Step, tokens seen and RNG; the model's identity stays this run's (check_model compared them)."""
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        # Read as data only (a checkpoint may come from anyone): any class in it is refused.
        generators = plain_loads(state["rng"], "train.rng") if state["rng"] else {}
        as_tensor = lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if "cpu" in generators:
            torch.set_rng_state(as_tensor(generators["cpu"]))
        if "cuda" in generators and torch.cuda.is_available():
            torch.cuda.set_rng_state(as_tensor(generators["cuda"]))


@dataclass
class Checkpointed:
    """The live objects a checkpoint holds, and their state as DCP saves it and loads it back."""

    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    train_state: TrainState
    dataloader: Any  # anything with state_dict() / load_state_dict()

    def state(self, parts=PARTS) -> dict:
        state = {}
        if "model" in parts:
            state["model"] = model_state(self.model_parts)
        if "optimizer" in parts:
            state["optimizer"] = optimizer_state(self.model_parts, self.optimizers)
        if "train" in parts:
            state["train"] = self.train_state.to_dict()
        if "dataloader" in parts:
            state["dataloader"] = self.dataloader.state_dict()
        return state

    def load(self, state: dict) -> None:
        """What a checkpoint's state() read into (tensors loaded in place), into the live objects."""
        if "model" in state:
            load_model_state(self.model_parts, state["model"])
        if "optimizer" in state:
            load_optimizer_state(self.model_parts, self.optimizers, state["optimizer"])
        if "train" in state:
            self.train_state.load_dict(state["train"])
        if "dataloader" in state:
            self.dataloader.load_state_dict(state["dataloader"])


def model_state(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters of every part this rank holds, under the full model's names."""
    return {name: tensor for part in model_parts for name, tensor in get_model_state_dict(part).items()}


def load_model_state(
    model_parts: list[nn.Module], state: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """strict=False: load what state holds of each part (initial weights without some buffers)."""
    for part in model_parts:
        own = {name: state[name] for name in get_model_state_dict(part) if strict or name in state}
        set_model_state_dict(part, own, options=StateDictOptions(strict=strict))


def optimizer_state(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    merged = {}
    for part, optimizer in zip(model_parts, optimizers):
        merged.update(get_optimizer_state_dict(part, optimizer, options=FLAT))
    return merged


def load_optimizer_state(
    model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], state: dict
) -> None:
    """Load each part's optimizer state; the parameter groups' settings (lr, betas, Muon's...) stay
    this run's config's, as a resumed run must follow its config. Settings the state lacks (an older
    checkpoint) keep their values."""
    changed: dict[str, tuple] = {}  # setting -> (the checkpoint's value, ours), the first seen
    for part, optimizer in zip(model_parts, optimizers):
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        ours = get_optimizer_state_dict(part, optimizer, options=FLAT)
        own = {key: state.get(key, value) for key, value in ours.items()}
        for key, value in ours.items():  # "param_groups.<parameter>.<setting>"
            setting = key.rsplit(".", 1)[-1]
            if key.startswith("param_groups.") and setting not in SCHEDULED and own[key] != value:
                changed.setdefault(setting, (own[key], value))
        set_optimizer_state_dict(part, optimizer, own, options=FLAT)
        for group, kept in zip(optimizer.param_groups, settings):
            group.update(kept)
    if changed:
        said = "; ".join(
            f"{setting} {there} there, {here} here" for setting, (there, here) in sorted(changed.items())
        )
        logger.info(f"optimizer settings from the config, not the checkpoint's: {said}")
