"""Hugging Face safetensors: read into a (sharded) model, write a full model, via the model's adapter.

Reading maps names first, from the files' headers alone; then each rank reads only what it holds:
nothing of the tensors of other pipeline stages, and of a sharded (DTensor) parameter only the box
of rows and columns its shard covers. Where the adapter converts rows in blocks (Llama's q/k heads)
the box grows to whole blocks, is converted, then cut. A stacked expert tensor (experts, in, out) is
read from its per-expert Hugging Face tensors, only those of the experts in the rank's box (FSDP or
expert parallelism shard dim 0). Memory and reads per rank are its shard's.

Float8 checkpoints with block scales (DeepSeek-V3's, Kimi K2's): a weight `X.weight` stored as float8
beside `X.weight_scale_inv` (in any file of the folder), one float32 scale per block of
FLOAT8_BLOCK x FLOAT8_BLOCK values (the last blocks partial), is dequantized while read: the box
read is multiplied by the scales of the blocks it overlaps, which alone are read.

MXFP4 checkpoints (gpt-oss's experts): a tensor `X` stored as `X_blocks` and `X_scales`
(checkpoint/mxfp4.py) is dequantized while read, the box reading only its rows and blocks.
"""

import contextlib
import json
import re
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from checkpoint import mxfp4
from configs import UserError
from data.tokenizer import Tokenizer, build_tokenizer
from models.hf_adapter import StateDictAdapter
from parallelisms.wrapper_names import original_name

SHARD_BYTES = 5 * 2**30
# DeepSeek's float8 weights: `X.weight` is scaled by `X.weight_scale_inv`, one scale per block of
# FLOAT8_BLOCK x FLOAT8_BLOCK (inference/kernel.py of deepseek-ai/DeepSeek-V3).
SCALE_SUFFIX = "_scale_inv"
FLOAT8_BLOCK = 128
Files = Callable[[Path], Any]
"""A function giving a file's opened safetensors (_files)."""
# What of model.hf_assets_path the export carries: the files data/tokenizer.py reads, and the map
# of special tokens that transformers' tokenizer loading also looks for.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def require(adapter: StateDictAdapter | None) -> StateDictAdapter:
    """The family's adapter; a family without one (ModelSpec.state_dict_adapter None) is refused."""
    if adapter is None:
        raise UserError("this model family has no Hugging Face adapter (ModelSpec.state_dict_adapter)")
    return adapter


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))


@contextlib.contextmanager
def _open(file: Path) -> Iterator:
    """safe_open, with a damaged or truncated file reported as the user's to fix."""
    try:
        with safe_open(str(file), framework="pt") as tensors:
            yield tensors
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file} cannot be read as safetensors (truncated or damaged?): {e}") from None


@contextlib.contextmanager
def _files() -> Iterator[Files]:
    """A function giving a file's opened safetensors, each file opened once and kept open until the
    end: a weight's file, and its scales' where DeepSeek's sharding put them in another."""
    with contextlib.ExitStack() as stack:
        opened = {}

        def get(file: Path):
            if file not in opened:
                opened[file] = stack.enter_context(_open(file))
            return opened[file]

        yield get


@dataclass(frozen=True)
class Location:
    """Where one of our tensors, or one expert of a stacked one, lies in a Hugging Face folder."""

    file: Path
    hf_name: str
    shape: tuple[int, ...]
    expert: int | None = None
    """The index in dim 0 of our stacked tensor that this Hugging Face tensor fills; None: all of it."""
    scale: "Location | None" = None
    """Where a float8 weight's block scales (`<hf_name>_scale_inv`) lie, or an MXFP4 tensor's scales;
    None: stored unscaled."""
    mxfp4: bool = False
    """Stored as MXFP4 blocks (hf_name `X_blocks`, shape the blocks'), with scales."""


def locate(
    folder: Path, adapter: StateDictAdapter, shapes: dict[str, tuple[int, ...]]
) -> dict[str, list[Location]]:
    """Where each tensor of `shapes` (our names -> expected shapes) lies, read from the headers only:
    one location, or one per expert for a stacked expert tensor, with its block scales if any.

    Tensors not in `shapes` (another pipeline stage's) are skipped; unknown names, other shapes and
    missing tensors are the user's mistake (a checkpoint of another model or flavor).
    """
    found, scales, stored = defaultdict(list), {}, set()
    for file in sorted(folder.glob("*.safetensors")):
        with _open(file) as tensors:
            for hf_name in tensors.keys():
                if hf_name.endswith(".weight" + SCALE_SUFFIX):  # paired below: its weight may be elsewhere
                    shape = tuple(tensors.get_slice(hf_name).get_shape())
                    scales[hf_name.removesuffix(SCALE_SUFFIX)] = Location(file, hf_name, shape)
                    continue
                if hf_name.endswith(mxfp4.SCALES_SUFFIX):  # an MXFP4 tensor's, keyed by its blocks' name
                    shape = tuple(tensors.get_slice(hf_name).get_shape())
                    blocks = hf_name.removesuffix(mxfp4.SCALES_SUFFIX) + mxfp4.BLOCKS_SUFFIX
                    scales[blocks] = Location(file, hf_name, shape)
                    continue
                stored.add(hf_name)
                packed = hf_name.endswith(mxfp4.BLOCKS_SUFFIX)
                tensor_name = hf_name.removesuffix(mxfp4.BLOCKS_SUFFIX) if packed else hf_name
                try:
                    name, expert = adapter.from_hf_name(tensor_name), adapter.expert_index(tensor_name)
                except KeyError as e:
                    raise UserError(f"{file}: {e.args[0]} (is this checkpoint of another model?)") from None
                if name not in shapes:
                    continue
                shape = tuple(tensors.get_slice(hf_name).get_shape())
                ours = tuple(shapes[name])
                # An expert's tensor is an nn.Linear weight (out, in) of our (experts, in, out).
                expected = ours if expert is None else (ours[2], ours[1])
                holds = mxfp4.unpacked_shape(shape) if packed and len(shape) >= 3 else shape
                if holds != expected or (expert is not None and expert >= ours[0]):
                    what = "" if expert is None else f" (expert {expert}: {expected} each)"
                    packing = f" ({holds} unpacked)" if packed else ""
                    raise UserError(
                        f"{file}: {hf_name} is {shape}{packing}, but the model's {name} is {ours}{what}"
                    )
                found[name].append(Location(file, hf_name, shape, expert, mxfp4=packed))
    pieces = lambda name: shapes[name][0] if adapter.is_stacked(name) else 1
    missing = sorted(name for name in shapes if len({loc.expert for loc in found[name]}) < pieces(name))
    if missing:
        count = f"{len(missing)} tensor{'s' * (len(missing) != 1)}"
        raise UserError(f"Hugging Face checkpoint {folder} lacks {count}, e.g. {missing[0]}")
    orphans = sorted(set(scales) - stored)
    if orphans:
        scale = scales[orphans[0]]
        raise UserError(f"{scale.file}: {scale.hf_name} scales {orphans[0]}, which the checkpoint lacks")
    return {name: [_with_scale(loc, scales.get(loc.hf_name)) for loc in locs] for name, locs in found.items()}


def _with_scale(location: Location, scale: Location | None) -> Location:
    """location with its block scales, whose shape is checked: one per block of the weight."""
    if scale is None:
        if location.mxfp4:
            scales = location.hf_name.removesuffix(mxfp4.BLOCKS_SUFFIX) + mxfp4.SCALES_SUFFIX
            raise UserError(f"{location.file}: {location.hf_name} is MXFP4 without the {scales} scaling it")
        return location
    if location.mxfp4:
        if not mxfp4.scales_fit(location.shape, scale.shape):
            raise UserError(
                f"{scale.file}: {scale.hf_name} is {scale.shape}, but {location.hf_name} {location.shape} "
                f"has {location.shape[:-1]} blocks of {mxfp4.VALUES_PER_BLOCK} values"
            )
        return replace(location, scale=scale)
    blocks = tuple(-(-size // FLOAT8_BLOCK) for size in location.shape)
    if len(location.shape) != 2 or scale.shape != blocks:
        raise UserError(
            f"{scale.file}: {scale.hf_name} is {scale.shape}, but {location.hf_name} {location.shape} "
            f"has {blocks} blocks of {FLOAT8_BLOCK} x {FLOAT8_BLOCK}"
        )
    return replace(location, scale=scale)


def _read(files: Files, location: Location, box: tuple[slice, ...]) -> torch.Tensor:
    """The box (a slice per dim) of a Hugging Face tensor as stored there; a float8 weight's values
    times their blocks' scales, in float32 (DeepSeek's product), reading only the scales of the
    blocks the box overlaps; an MXFP4 tensor's box (in our layout) dequantized (bfloat16)."""
    if location.mxfp4:
        scales = files(location.scale.file).get_slice(location.scale.hf_name)
        return mxfp4.read_box(files(location.file).get_slice(location.hf_name), scales, box)
    values = files(location.file).get_slice(location.hf_name)[box]
    if location.scale is None:
        if values.is_floating_point() and values.element_size() == 1:
            raise UserError(
                f"{location.file}: {location.hf_name} is {values.dtype} without the "
                f"{location.hf_name}{SCALE_SUFFIX} that scales it"
            )
        return values
    blocks = tuple(slice(part.start // FLOAT8_BLOCK, -(-part.stop // FLOAT8_BLOCK)) for part in box)
    scale = files(location.scale.file).get_slice(location.scale.hf_name)[blocks]
    # One scale per value: each block's repeated over its rows (then columns), cut to the box.
    for dim, (part, block) in enumerate(zip(box, blocks)):
        start = part.start - block.start * FLOAT8_BLOCK
        scale = scale.repeat_interleave(FLOAT8_BLOCK, dim).narrow(dim, start, values.shape[dim])
    return values.to(torch.float32) * scale


def _read_box(
    files: Files, location: Location, name: str, adapter: StateDictAdapter, box: tuple[slice, ...]
) -> torch.Tensor:
    """Our tensor `name`'s values in `box` (a slice per dim), reading whole blocks of rows around it."""
    rows, *columns = box
    block = adapter.rows_per_block(name)
    first, end = rows.start // block * block, -(-rows.stop // block) * block
    read = _read(files, location, (slice(first, end), *columns))
    return adapter.block_from_hf(name, read)[rows.start - first : rows.stop - first]


def _read_expert(files: Files, location: Location, box: tuple[slice, slice]) -> torch.Tensor:
    """The (in, out) box of one expert of our stacked tensor, from its Linear weight (out, in)."""
    inputs, outputs = box
    return _read(files, location, (outputs, inputs)).T


def _local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """The rows and columns of the full tensor that this rank's shard of param holds."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    # The function DCP uses to describe each shard as one box of the full tensor (Shard, uneven last
    # chunks, FSDP's strided shard over TP on a 2-D mesh).
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):
        raise RuntimeError(f"local shape {tuple(shape)} is not the shard's {tuple(param.to_local().shape)}")
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def _by_file(locations: dict[str, list[Location]]) -> dict[Path, list[tuple[str, Location]]]:
    grouped = defaultdict(list)
    for name, pieces in locations.items():
        for location in pieces:
            grouped[location.file].append((name, location))
    return grouped


@torch.no_grad()
def load_into(model_parts: list[nn.Module], adapter: StateDictAdapter, folder: Path) -> None:
    """Fill the parameters of model_parts (this rank's stage, maybe sharded) from folder's safetensors."""
    params = {original_name(n): p for part in model_parts for n, p in part.named_parameters()}
    locations = locate(folder, adapter, {name: tuple(p.shape) for name, p in params.items()})
    for entries in _by_file(locations).values():
        with _files() as files:
            for name, location in entries:
                param = params[name]
                local = param.to_local() if isinstance(param, DTensor) else param
                if not local.numel():  # an uneven split may leave a rank nothing
                    continue
                box = _local_box(param)
                if location.expert is None:
                    local.copy_(_read_box(files, location, name, adapter, box))
                elif box[0].start <= location.expert < box[0].stop:  # an expert this rank holds
                    local[location.expert - box[0].start].copy_(_read_expert(files, location, box[1:]))


def read_full(
    folder: Path, adapter: StateDictAdapter, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The full tensors of `shapes` (our names and layout), in dtype or the files' own (float32 for
    dequantized float8 weights)."""
    state = {}
    for entries in _by_file(locate(folder, adapter, shapes)).values():
        with _files() as files:
            for name, location in entries:
                whole = tuple(slice(0, n) for n in shapes[name])
                if location.expert is None:
                    full = _read_box(files, location, name, adapter, whole)
                    state[name] = full if dtype is None else full.to(dtype)
                    continue
                expert = _read_expert(files, location, whole[1:])
                if name not in state:
                    state[name] = torch.empty(shapes[name], dtype=dtype or expert.dtype)
                state[name][location.expert] = expert
    return state


def save(
    state_dict: dict[str, torch.Tensor],
    adapter: StateDictAdapter,
    folder: Path,
    dtype: torch.dtype,
    hf_assets_path: str,
) -> None:
    """Write full tensors (our names) as a folder that transformers loads and generates from:
    safetensors shards + index, config.json and generation_config.json with the token ids of the
    tokenizer the run trained with (hf_assets_path, or the byte tokenizer), and its files."""
    # Before writing: a missing tokenizer or a model that Hugging Face cannot express stops it first.
    tokenizer = build_tokenizer(hf_assets_path)
    require_hf_names(state_dict, adapter)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    config = {**adapter.hf_config(str(dtype).removeprefix("torch.")), **ids}
    hf_state = {name: t.to(dtype).contiguous() for name, t in adapter.to_hf(state_dict).items()}
    folder.mkdir(parents=True, exist_ok=False)
    weight_map = _write_shards(hf_state, folder)
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(folder / "model.safetensors.index.json", index)
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", generation_config(tokenizer))
    for name in TOKENIZER_FILES if hf_assets_path else ():
        if (Path(hf_assets_path) / name).is_file():
            shutil.copyfile(Path(hf_assets_path) / name, folder / name)


def require_hf_names(state_dict: dict[str, torch.Tensor], adapter: StateDictAdapter) -> None:
    """Every tensor has a Hugging Face name; the first that has none (a fork's new parameter, such as
    the bias of a LayerNorm swapped in) is the user's to map, in the adapter's names."""
    for name in state_dict:
        try:
            adapter.to_hf_name(name, 0 if adapter.is_stacked(name) else None)
        except KeyError:
            template = re.sub(r"(?<=\.)\d+(?=\.)", "{}", name)
            module = type(adapter).__module__
            raise UserError(
                f'the model\'s parameter {name} has no Hugging Face name: add "{template}": "<its name in '
                f'transformers>" to the names of {type(adapter).__name__} ({module.replace(".", "/")}.py), '
                "for a transformers architecture that has this weight (docs/forking.md, HF adapter)"
            ) from None


def _write_shards(hf_state: dict[str, torch.Tensor], folder: Path) -> dict[str, str]:
    """Shards of at most SHARD_BYTES; returns the index's weight map (tensor -> file)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    file_mode = folder.stat().st_mode & 0o666  # what the umask gives new files here
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = folder / f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(file), metadata={"format": "pt"})
        file.chmod(file_mode)  # safetensors (0.8) creates its files 0600 whatever the umask
        weight_map.update(dict.fromkeys(shard, file.name))
    return weight_map


def generation_config(tokenizer: Tokenizer) -> dict:
    """Greedy decoding that stops at the end-of-text token the model was trained to emit. No length:
    transformers would warn whenever a caller's max_new_tokens overrides one set here."""
    config = {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.eos_id,  # no padding token in pretraining; batched generate needs one
        "do_sample": False,
    }
    return {key: value for key, value in config.items() if value is not None}


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")
