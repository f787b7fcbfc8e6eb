"""Hugging Face safetensors: read into a (sharded) model, write a full model, via the model's adapter.

Reading goes one tensor at a time: each full tensor is renamed/permuted by the adapter and every
rank copies its own shard out of it, so memory holds one full tensor at a time whatever the layout.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from configs import UserError
from training.weight_init import copy_full_tensor, original_name

SHARD_BYTES = 5 * 2**30


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))


def load_into(model_parts: list[nn.Module], adapter, folder: Path) -> None:
    """Fill the parameters of model_parts from the safetensors files in folder."""
    params = {original_name(n): p for part in model_parts for n, p in part.named_parameters()}
    wanted = set(params)
    loaded = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for hf_name in tensors.keys():
                try:
                    converted = adapter.from_hf({hf_name: tensors.get_tensor(hf_name)})
                except KeyError as e:
                    raise UserError(f"{file}: {e.args[0]} (is this checkpoint of another model?)") from None
                for name, full in converted.items():
                    if name not in wanted:
                        continue  # held by another pipeline stage
                    param = params[name]
                    if tuple(full.shape) != tuple(param.shape):
                        shapes = f"{tuple(full.shape)}, this model's {name} is {tuple(param.shape)}"
                        raise UserError(f"{file}: {hf_name} is {shapes}")
                    with torch.no_grad():
                        copy_full_tensor(param, full.to(param.device, param.dtype))
                    loaded.add(name)
    missing = sorted(wanted - loaded)
    if missing:
        raise UserError(f"Hugging Face checkpoint {folder} lacks {len(missing)} tensors, e.g. {missing[0]}")


def save(state_dict: dict[str, torch.Tensor], adapter, folder: Path, dtype: torch.dtype) -> None:
    """Write full tensors (our names) as HF safetensors shards + index + config.json."""
    hf_state = {name: t.to(dtype).contiguous() for name, t in adapter.to_hf(state_dict).items()}
    folder.mkdir(parents=True, exist_ok=False)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = adapter.hf_config(str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
