"""DeepSeek's float8 checkpoints (DeepSeek-V3, Kimi K2) import: each float8 weight with its 128 x 128
block scales (`weight_scale_inv`, maybe in another shard) is dequantized while read, each rank
reading only its box and the scales of the blocks that box overlaps (checkpoint/hf.py)."""

import contextlib
import functools
import json
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, read_metrics, run_train
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

from checkpoint import hf
from configs import UserError, load_config
from models import get_model_spec
from models.spec import model_args
from parallelisms import ParallelDims
from parallelisms.wrapper_names import original_name
from training.model_setup import build_model
from training.weight_init import init_weights, materialize

SPEC = get_model_spec("deepseek_v3")
BLOCK = 128  # DeepSeek's block of scales
# The tiny flavor widened so that weights span two blocks, the second partial (192 and 160 are not
# multiples of 128), and a 2-rank split of 160 rows (80 each) cuts a block.
CHANGES = ["dim=192", "expert_hidden_dim=160", "shared_hidden_dim=160"]
MODEL = ["--model.name", "deepseek_v3", "--model.args", ",".join(CHANGES)]
SEQ_LEN, VOCAB = 32, 258  # tests/tiny.toml's sequence, the byte tokenizer
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
LAYOUTS = {  # in-process 2-rank layouts: FSDP cuts rows (experts over EP), TP cuts rows or columns
    "ep2_fsdp2": {"expert_parallel_degree": 2},
    "tp2": {"tensor_parallel_degree": 2},
}


def quantized(hf_name: str) -> bool:
    """What DeepSeek stores as float8: the Linear weights of attention (q_a_proj, q_b_proj,
    kv_a_proj_with_mqa, kv_b_proj, o_proj), of dense, shared and routed experts (gate/up/down_proj)
    and the MTP projection (eh_proj); not norms, embeddings, heads or the router (mlp.gate)."""
    return hf_name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and float32 scales, one per 128 x 128 block (its largest magnitude
    mapped to float8's largest), as DeepSeek's checkpoints hold them."""
    rows, columns = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -columns % BLOCK, 0, -rows % BLOCK))
    blocks = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))  # (row block, row, col block, col)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    values = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.flatten(2).flatten(0, 1)[:rows, :columns].contiguous(), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: each block of values (as float32) times its scale, block by block."""
    out = values.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] *= scale[i, j]
    return out


def write_deepseek_style(hf_state: dict[str, torch.Tensor], folder: Path, config: dict) -> None:
    """hf_state (full precision) as DeepSeek lays its checkpoints out: float8 weights with their
    `weight_scale_inv`, the rest bf16 (the expert bias float32), two tensors per file with an index,
    so that some scales lie in another file than their weight."""
    tensors = {}
    for name, tensor in hf_state.items():
        if quantized(name):
            tensors[name], tensors[f"{name}_scale_inv"] = quantize(tensor)
        else:
            keep = name.endswith("e_score_correction_bias")
            tensors[name] = tensor.float() if keep else tensor.to(torch.bfloat16)
    names = list(tensors)
    files = [names[i : i + 2] for i in range(0, len(names), 2)]
    folder.mkdir()
    weight_map = {}
    for index, group in enumerate(files, 1):
        file = f"model-{index:05d}-of-{len(files):06d}.safetensors"  # DeepSeek-V3's: -of-000163
        save_file({name: tensors[name] for name in group}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    quantization = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> SimpleNamespace:
    """The seeded tiny model exported by hf.save (float32), and the same weights rewritten as
    DeepSeek's float8 checkpoints are."""
    root = tmp_path_factory.mktemp("deepseek_fp8")
    args = model_args(SPEC, "tiny", SEQ_LEN, VOCAB, CHANGES)
    with torch.device("meta"):
        model, template = SPEC.model_cls(args), SPEC.model_cls(args)
    materialize(model, torch.device("cpu"))
    init_weights(model, template, seed=7)  # not the runs' job.seed: a fresh init differs
    state = {name: p.detach() for name, p in model.named_parameters()}
    for name, bias in model.named_buffers():
        if name.endswith("expert_bias"):  # in DeepSeek's files (float32), not a parameter to import
            state[name] = bias
    adapter = SPEC.adapter(args)
    hf.save(state, adapter, root / "hf", torch.float32, hf_assets_path="")
    hf_state = {}
    for file in sorted((root / "hf").glob("*.safetensors")):
        hf_state.update(load_file(str(file)))
    config = json.loads((root / "hf" / "config.json").read_text())
    write_deepseek_style(hf_state, root / "fp8", config)
    weight_map = json.loads((root / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    scaled = [name for name in weight_map if name.endswith("_scale_inv")]
    assert any(weight_map[name] != weight_map[name.removesuffix("_scale_inv")] for name in scaled)
    assert "model.layers.3.eh_proj.weight_scale_inv" in weight_map  # the MTP layer's projection
    assert "model.layers.3.shared_head.head.weight" in weight_map  # its copies, ignored on import
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return SimpleNamespace(hf=root / "hf", fp8=root / "fp8", args=args, adapter=adapter, shapes=shapes)


def reference_import(folder: Path, adapter) -> dict[str, torch.Tensor]:
    """Every file loaded whole, each float8 weight dequantized by `dequantize`, in our names."""
    stored = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(str(file)))
    hf_state = {
        name: dequantize(t, stored[f"{name}_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
        for name, t in stored.items()
        if not name.endswith("_scale_inv")
    }
    return adapter.from_hf(hf_state)


def test_read_full_dequantizes_each_block(checkpoints):
    """hf.read_full (scripts/convert_hf_to_dcp.py) gives the reference dequantization exactly for
    every float8 weight (float32), and the bf16 tensors as stored; scales are no tensors of ours."""
    state = hf.read_full(checkpoints.fp8, checkpoints.adapter, checkpoints.shapes, None)
    want = reference_import(checkpoints.fp8, checkpoints.adapter)
    assert set(state) == set(checkpoints.shapes)
    exported = hf.read_full(checkpoints.hf, checkpoints.adapter, checkpoints.shapes, None)
    float8 = 0
    for name, tensor in state.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
        if tensor.dtype == torch.float32:  # dequantized: float8's rounding, within its 2^-4 relative step
            float8 += 1
            error = (tensor - exported[name]).abs()
            assert 0 < error.max() and (error <= exported[name].abs() / 16 + 1e-6).all(), name
    # Every Linear of attention (5 in each of the 4 blocks, the MTP one's included), of the dense
    # and the shared feed-forwards (3 each), the stacked experts (3 per MoE block), the MTP projection.
    assert float8 == 4 * 5 + 3 + 3 * 3 + 3 * 3 + 1


@contextlib.contextmanager
def recording_safe_open(reads: list, file: str, framework: str):
    """safe_open whose slices record each read: (Hugging Face name, box, elements)."""

    class Recorded:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, box):
            values = self.inner[box]
            reads.append((self.name, box, values.numel()))
            return values

    with safe_open(file, framework=framework) as opened:
        yield SimpleNamespace(keys=opened.keys, get_slice=lambda name: Recorded(opened.get_slice(name), name))


def blocks_of(box: tuple[slice, slice]) -> int:
    """The 128 x 128 blocks that a box of a weight overlaps: the scales it needs."""
    rows, columns = (-(-part.stop // BLOCK) - part.start // BLOCK for part in box)
    return rows * columns


def stored_elements(folder: Path) -> dict[str, int]:
    """Hugging Face name -> elements that the folder's files hold of it (headers only)."""
    stored = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as opened:
            stored.update(
                {name: torch.Size(opened.get_slice(name).get_shape()).numel() for name in opened.keys()}
            )
    return stored


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.filterwarnings("ignore:Parallelize plan key")
def test_each_rank_reads_its_box_and_the_scales_it_overlaps(checkpoints, layout, monkeypatch):
    """Two ranks simulated in turn: each gets the reference's values of its shard; reads exactly
    its shard's elements of every weight (no read of a whole tensor it holds a part of), and of
    the scales only those of the blocks its boxes overlap; altogether less than the checkpoint."""
    overrides = [f"--parallelism.{key}={value}" for key, value in LAYOUTS[layout].items()]
    config = load_config([*TINY, *MODEL, *overrides])
    dims = ParallelDims.from_config(config.parallelism, 2)
    adapter, stored = checkpoints.adapter, stored_elements(checkpoints.fp8)
    full = {name: t.float() for name, t in reference_import(checkpoints.fp8, adapter).items()}
    partial_scale_reads = 0
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        _clear_sharding_prop_cache()  # the two simulated ranks' meshes compare equal
        try:
            mesh = dims.build_mesh("cpu")
            parts = build_model(config, dims, mesh, torch.device("cpu"), initialize=False).parts
            for part in parts:
                materialize(part, torch.device("cpu"))
            reads = []
            monkeypatch.setattr(hf, "safe_open", functools.partial(recording_safe_open, reads))
            hf.load_into(parts, adapter, checkpoints.fp8)
            params = {original_name(n): p for part in parts for n, p in part.named_parameters()}
        finally:
            dist.destroy_process_group()
        assert set(params) == set(checkpoints.shapes)
        weights, scales, expected_scales = Counter(), Counter(), Counter()
        for hf_name, box, count in reads:
            if hf_name.endswith("_scale_inv"):
                scales[hf_name] += count
                partial_scale_reads += count < stored[hf_name]
            else:
                weights[hf_name] += count
                if f"{hf_name}_scale_inv" in stored:
                    expected_scales[f"{hf_name}_scale_inv"] += blocks_of(box)
        assert scales == expected_scales, rank  # per weight read, the scales of its blocks
        for name, param in params.items():
            local, want = param, full[name]
            if isinstance(param, DTensor):
                local = param.to_local()
                want = distribute_tensor(
                    want, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
            assert torch.equal(local, want), (rank, name)
            experts = range(param.shape[0]) if adapter.is_stacked(name) else [None]
            pieces = {adapter.to_hf_name(name, expert) for expert in experts}
            assert sum(weights[piece] for piece in pieces) == local.numel(), (rank, name)
            if local.numel() < param.numel():  # a part of it: no read of the whole tensor
                largest = max(count for piece, _, count in reads if piece in pieces)
                assert largest <= local.numel() and largest < param.numel(), (rank, name)
        total_read, total_stored = sum(count for _, _, count in reads), sum(stored.values())
        print(f"{layout} rank {rank}: read {total_read} of the checkpoint's {total_stored} elements")
        assert total_read < total_stored
    assert partial_scale_reads  # a box within the blocks of a weight read only some of its scales


def rewritten(folder: Path, tmp_path: Path, change) -> Path:
    """A copy of folder whose files' tensors change(tensors) rewrote (a dict, changed in place)."""
    copy = tmp_path / "changed"
    shutil.copytree(folder, copy)
    for file in sorted(copy.glob("*.safetensors")):
        tensors = load_file(str(file))
        change(tensors)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return copy


SCALES = "model.layers.1.mlp.shared_experts.gate_proj.weight_scale_inv"  # (160, 192): 2 x 2 blocks


def drop_scales(tensors: dict) -> None:
    tensors.pop(SCALES, None)


def cut_scales(tensors: dict) -> None:
    if SCALES in tensors:
        tensors[SCALES] = tensors[SCALES][:1].clone()


def rename_scales(tensors: dict) -> None:
    if SCALES in tensors:
        tensors[SCALES.replace("gate_proj", "gates_proj")] = tensors.pop(SCALES)


@pytest.mark.parametrize(
    "change, expected",
    [
        (drop_scales, r"gate_proj.weight is torch.float8_e4m3fn without the \S+gate_proj.weight_scale_inv"),
        (cut_scales, r"gate_proj.weight_scale_inv is \(1, 2\), but \S+ \(160, 192\) has \(2, 2\) blocks"),
        (
            rename_scales,
            r"gates_proj.weight_scale_inv scales \S+gates_proj.weight, which the checkpoint lacks",
        ),
    ],
    ids=["weight without its scales", "scales of other blocks", "scales without their weight"],
)
def test_unusable_scales_are_the_users_to_fix(checkpoints, tmp_path, change, expected):
    folder = rewritten(checkpoints.fp8, tmp_path, change)
    with pytest.raises(UserError, match=expected):
        hf.read_full(folder, checkpoints.adapter, checkpoints.shapes, None)


def test_training_starts_from_float8_weights_on_any_layout(checkpoints, tmp_path):
    """train.py from checkpoint.initial_load_path: the first loss equal in one process and at
    EP 2 x FSDP 2, and near the run from the float32 export."""
    runs = {  # name: (weights, processes, local batch); the global batch is 4 in each
        "fp8": (checkpoints.fp8, None, 4),
        "fp32": (checkpoints.hf, None, 4),
        "fp8_ep2": (checkpoints.fp8, 2, 2),
    }

    def first_loss(name: str) -> float:
        folder, nproc, local = runs[name]
        layout = ["--parallelism.expert_parallel_degree", "2"] if nproc else []
        run_train(
            [*TINY, *MODEL, *layout, "--training.steps", "1", "--training.local_batch_size", str(local),
             "--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(tmp_path / name)],
            nproc=nproc,
        )  # fmt: skip
        return read_metrics(tmp_path / name)[0]["loss"]

    with ThreadPoolExecutor(2) as pool:  # the one-process runs side by side: one thread each, two cores
        losses = dict(zip(runs, pool.map(first_loss, ["fp8", "fp32"])))
    losses["fp8_ep2"] = first_loss("fp8_ep2")
    assert losses["fp8_ep2"] == pytest.approx(losses["fp8"], rel=1e-6)
    # float8 rounds each weight by up to 2^-4 of itself (3 mantissa bits; the rest is bf16, 2^-9),
    # which moved the first loss by 8.0e-4 (6.25283 against 6.25202, torch 2.13 on CPU). 4e-3 leaves
    # room for other kernels' summation orders; reading the float8 values unscaled moves it by 0.047,
    # a fresh init by 0.41.
    assert 0 < abs(losses["fp8"] - losses["fp32"]) < 4e-3, losses
