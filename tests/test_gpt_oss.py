"""The gpt-oss family (models/gpt_oss/): published parameter counts, YaRN without rounding, logits
equal to transformers' GptOssForCausalLM and the published config.json on export, attention with
sinks in sliding windows on a context-parallel rank (the keys outside a chunk's window skipped), the
clamped experts (grouped GEMM against the loop), and OpenAI's MXFP4 checkpoints read as
transformers dequantizes them, each rank reading only its experts."""

import dataclasses
import functools
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers
from conftest import TINY
from safetensors.torch import load_file, save_file
from test_deepseek_v3_hf_import import recording_safe_open, rewritten
from test_hf import no_warnings_from_transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import models.grouped_experts as grouped_experts
from checkpoint import hf, mxfp4
from configs import UserError, load_config
from models import get_model_spec
from models.attention import causal_mask, document_ids, document_mask, sink_attention, within_window
from models.rope import rope_amplitude, rope_frequencies
from models.spec import model_args
from parallelisms import ParallelDims, context_parallel
from parallelisms.context_parallel import ContextParallelSinkAttention, WholeSequenceExchange, local_positions
from parallelisms.wrapper_names import original_name
from training.model_setup import build_model
from training.weight_init import init_weights, materialize

SPEC = get_model_spec("gpt_oss")


@pytest.mark.parametrize("flavor, total, active", [("20B", 20.91, 3.61), ("120B", 116.83, 5.13)])
def test_published_shapes_have_their_parameter_counts(flavor, total, active):
    """Billions of parameters as OpenAI's model card gives them (two decimals): all, and those one
    token goes through, the embedding table aside (the card counts the unembedding only)."""
    with torch.device("meta"):
        model = SPEC.model_cls(SPEC.flavors[flavor])
    counted = sum(p.numel() for p in model.parameters())
    through = model.active_parameters() - model.tok_embeddings.weight.numel()
    assert (round(counted / 1e9, 2), round(through / 1e9, 2)) == (total, active)


def test_yarn_equals_transformers_without_rounding():
    """The published flavors' RoPE: transformers' YaRN of GptOssConfig's defaults (factor 32 over
    4,096 tokens, theta 150,000, the ramp's ends not rounded, which changes the frequencies here)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    frequencies, amplitude = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig(), "cpu")
    args = SPEC.flavors["120B"]
    ours = rope_frequencies(args.head_dim, args.rope_theta, args.yarn())
    torch.testing.assert_close(ours, frequencies, rtol=1e-6, atol=0)
    assert rope_amplitude(args.yarn()) == pytest.approx(amplitude, rel=1e-12)
    rounded = dataclasses.replace(args.yarn(), truncate=True)
    assert not torch.allclose(rope_frequencies(args.head_dim, args.rope_theta, rounded), frequencies)


def tiny_model(changes: list[str] = (), seq: int = 64):
    args = model_args(SPEC, "tiny", seq, 258, list(changes))
    model = SPEC.model_cls(args)
    with torch.device("meta"):
        template = SPEC.model_cls(args)
    init_weights(model, template, seed=0)
    model.init_buffers()
    return args, model


def test_logits_equal_transformers(tmp_path):
    """The export loads into GptOssForCausalLM with no warning and no missing, unexpected or
    mismatched key, and gives our logits (fp32): sliding blocks (window 6 of 64 tokens) and full
    ones, the sinks, the biases, YaRN, and experts whose gate and up values reach beyond the clamp."""
    torch.manual_seed(0)
    args, model = tiny_model()
    state = {name: p.detach() for name, p in model.named_parameters()}
    for name, tensor in state.items():
        if ".moe." in name:  # sharper routing, larger expert outputs: wrong routing would show
            tensor.mul_(20 if name.endswith("gate_up") else 5)  # gate and up values beyond the clamp
        if name.endswith(("bias", "sinks")):  # zero at init: make them count
            tensor.copy_(torch.randn_like(tensor) * 0.5)
    projected = []
    experts = model.layers["1"].moe.experts
    experts.register_forward_pre_hook(  # expert 0's gate and up values, on its tokens
        lambda m, inputs: projected.append(inputs[0][: inputs[1][0]] @ m.gate_up[0] + m.gate_up_bias[0])
    )
    hf.save(state, SPEC.adapter(args), tmp_path / "hf", torch.float32, hf_assets_path="")
    with no_warnings_from_transformers():  # e.g. none about config.json's RoPE keys
        theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True
        )
    assert type(theirs).__name__ == "GptOssForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert theirs.config.layer_types == ["sliding_attention", "full_attention"]
    theirs.eval()
    tokens = torch.randint(0, 258, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    gate, up = projected[0][:, ::2], projected[0][:, 1::2]
    assert (gate > args.swiglu_limit).any() and (up.abs() > args.swiglu_limit).any()


@pytest.mark.parametrize("seq_len", [1024, 4096])
def test_export_config_is_the_published_one_at_any_training_length(seq_len):
    """config.json of a 120B export, whatever training.seq_len (the RoPE table's length), has
    openai/gpt-oss-120b's values, as transformers' GptOssConfig defaults hold them: shapes, windows,
    131,072 positions and YaRN 32 over 4,096 tokens (rope_scaling for transformers 4 and vLLM)."""
    ours = SPEC.adapter(model_args(SPEC, "120B", seq_len, 258, [])).hf_config("bfloat16")
    published = transformers.GptOssConfig(architectures=["GptOssForCausalLM"], dtype="bfloat16").to_dict()
    shared = ours.keys() & published.keys()
    assert {"max_position_embeddings", "rope_parameters", "layer_types", "num_local_experts"} <= shared
    assert {key: ours[key] for key in shared} == {key: published[key] for key in shared}
    assert ours["max_position_embeddings"] == 131072
    assert ours["rope_theta"] == 150000 and ours["rope_scaling"] == {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096,
    }  # fmt: skip


def test_routing_gpt_oss_cannot_express_is_refused_on_export():
    args = model_args(SPEC, "tiny", 64, 258, ["score_func=sigmoid", "router_bias=false"])
    with pytest.raises(UserError, match="this model's score_func, router_bias differ, so an export"):
        SPEC.adapter(args).hf_config("float32")


@pytest.mark.parametrize("attention_mask", ["causal", "document"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_rank_equals_the_whole_sequence(cp, attention_mask, monkeypatch):
    """Each cp rank's attention with sinks (its chunks' queries against the gathered keys, under
    the masks for its positions: causal or documents, and a window of 6, shorter than a chunk at cp 2
    and longer at cp 4) put together equals the whole sequence's: outputs, and the gradients of the
    queries, keys, values (those sent to their owners included) and sinks. The parts of the sequence
    wholly outside a chunk's window are skipped: each chunk's scores are computed over the keys from
    its window's start to its end only, at most chunk + 5 of the 32."""
    torch.manual_seed(0)
    seq, window = 32, 6
    q, k, v = (torch.randn(2, heads, seq, 8, requires_grad=True) for heads in (4, 2, 2))
    sinks = torch.randn(4, requires_grad=True)
    documents = document_ids(torch.randint(0, 8, (2, seq)), eos_id=0)  # documents of ~8 tokens

    def mask_for(positions: torch.Tensor | None) -> torch.Tensor:
        at = torch.arange(seq) if positions is None else positions
        full = document_mask(documents, positions) if attention_mask == "document" else causal_mask(at, seq)
        return within_window(full, at, window)

    whole = sink_attention(q, k, v, sinks, mask_for(None))
    dout = torch.randn_like(whole)
    whole.backward(dout)
    key_counts = []

    def counted(q, k, *rest):  # the keys each call's scores are computed over
        key_counts.append(k.shape[2])
        return sink_attention(q, k, *rest)

    monkeypatch.setattr(context_parallel, "sink_attention", counted)
    grads = [torch.zeros_like(t) for t in (q, k, v, sinks)]
    chunk = seq // (2 * cp)
    for rank in range(cp):
        positions = local_positions(seq, rank, cp)
        local = [t[:, :, positions].detach().requires_grad_() for t in (q, k, v)]
        mine = sinks.detach().requires_grad_()
        exchange = WholeSequenceExchange(torch.stack([k, v]).detach(), rank, cp)
        key_counts.clear()
        out = ContextParallelSinkAttention(exchange, window)(*local, mine, mask_for(positions))
        firsts = positions[::chunk].tolist()  # where the rank's two chunks start
        assert key_counts == [min(first, window - 1) + chunk for first in firsts]
        torch.testing.assert_close(out, whole[:, :, positions], rtol=1e-5, atol=1e-6)
        out.backward(dout[:, :, positions])
        grads[0][:, :, positions] += local[0].grad
        grads[1] += exchange.scattered[0]  # every key's gradient, this rank's own included
        grads[2] += exchange.scattered[1]
        grads[3] += mine.grad
    for total, leaf in zip(grads, (q, k, v, sinks)):
        torch.testing.assert_close(total, leaf.grad, rtol=1e-5, atol=1e-5)


def test_masks_follow_the_positions_held():
    """A context-parallel rank's model builds its masks for its chunks against the whole sequence:
    the same rows as the whole model's, for the full and the sliding blocks."""
    args, whole = tiny_model(seq=32)
    _, rank = tiny_model(seq=32)
    positions = local_positions(32, 1, 2)
    rank.init_buffers(positions)
    mine, all_of_them = rank.attention_masks(16, None, None), whole.attention_masks(32, None, None)
    assert set(mine) == {None, args.sliding_window}
    for window, mask in mine.items():
        assert torch.equal(mask, all_of_them[window][:, :, positions])
    assert torch.equal(all_of_them[None][0, 0], causal_mask(torch.arange(32), 32)[0, 0])
    assert all_of_them[6][0, 0, 20].nonzero().flatten().tolist() == list(range(15, 21))


def test_context_parallel_kernels_keep_their_blocks_windows():
    """Context parallelism swaps each block's kernel for one that knows the block's window, so the
    sliding block's skips the keys outside it and the full block's attends to all."""
    _, model = tiny_model(seq=32)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        context_parallel.apply_context_parallel(model, init_device_mesh("cpu", (2,)))
    finally:
        dist.destroy_process_group()
    kernels = [layer.attention.kernel for layer in model.layers.values()]
    assert all(isinstance(kernel, ContextParallelSinkAttention) for kernel in kernels)
    assert [kernel.window for kernel in kernels] == [6, None]


def expert_inputs():
    torch.manual_seed(0)
    counts = torch.tensor([6, 0, 9, 0, 5])  # experts 1 and 3 get no token
    tokens = torch.randn(int(counts.sum()), 16)
    # Weights large enough that gate and up values fall beyond the clamp (7) on both sides.
    weights = [torch.randn(5, 16, 64) * 2, torch.randn(5, 64), torch.randn(5, 32, 16), torch.randn(5, 16)]
    return tokens, counts, weights


def run_experts(tokens, counts, weights, grad_out):
    leaves = [t.clone().requires_grad_() for t in (tokens, *weights)]
    out = grouped_experts.expert_clamped_swiglu(leaves[0], counts, *leaves[1:], 1.702, 7.0)
    out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in leaves]


def test_clamped_experts_grouped_gemm_equals_the_loop(monkeypatch):
    """The grouped GEMMs (with each row's expert bias) and the loop's hand-written backward give
    the same outputs and gradients, clamped values included; experts without tokens get zeros."""
    tokens, counts, weights = expert_inputs()
    projected = tokens @ weights[0][0] + weights[1][0]
    assert (projected[:, ::2] > 7).any() and (projected[:, 1::2].abs() > 7).any()
    grad_out = torch.randn(tokens.shape[0], 16)
    grouped = run_experts(tokens, counts, weights, grad_out)
    monkeypatch.setattr(grouped_experts, "grouped_mm_runs", lambda *tensors: False)
    looped = run_experts(tokens, counts, weights, grad_out)
    torch.testing.assert_close(grouped[0], looped[0], rtol=1e-5, atol=1e-5)
    for mine, reference in zip(grouped[1], looped[1]):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-4)
    for grad in grouped[1][1:]:
        assert torch.all(grad[[1, 3]] == 0)


# ---- MXFP4 checkpoints ----


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (experts, in, out) tensor as OpenAI's checkpoints store it: blocks (experts, out, in / 32,
    16) of two FP4 values per byte, low nibble first, and a power-of-two scale per block of 32."""
    values = weight.transpose(1, 2).unflatten(-1, (-1, mxfp4.VALUES_PER_BLOCK))  # (E, out, groups, 32)
    exponent = torch.ceil(torch.log2(values.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    table = torch.tensor(mxfp4.FP4_VALUES)
    scaled = values / torch.exp2(exponent).unsqueeze(-1)
    nearest = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # (..., 32) codes
    blocks = nearest[..., 0::2] | (nearest[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> SimpleNamespace:
    """The seeded tiny model exported by hf.save (float32), and the same weights with the experts'
    two weights in MXFP4 (the rest bf16), as OpenAI's files hold them; scales in another file than
    their blocks."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    args, model = tiny_model(seq=32)
    state = {name: p.detach() for name, p in model.named_parameters()}
    adapter = SPEC.adapter(args)
    hf.save(state, adapter, root / "hf", torch.float32, hf_assets_path="")
    exported = {}
    for file in sorted((root / "hf").glob("*.safetensors")):
        exported.update(load_file(str(file)))
    files = [{}, {}]
    for name, tensor in exported.items():
        if name.endswith(("gate_up_proj", "down_proj")):
            blocks, scales = quantize(tensor)
            files[0][f"{name}_blocks"], files[1][f"{name}_scales"] = blocks, scales
        else:
            files[1][name] = tensor.to(torch.bfloat16)
    (root / "mxfp4").mkdir()
    weight_map = {}
    for index, tensors in enumerate(files, 1):
        save_file(tensors, str(root / "mxfp4" / f"model-{index:05d}-of-00002.safetensors"))
        weight_map.update(dict.fromkeys(tensors, f"model-{index:05d}-of-00002.safetensors"))
    (root / "mxfp4" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return SimpleNamespace(root=root, args=args, adapter=adapter, shapes=shapes, exported=exported)


def reference_import(folder: Path, adapter) -> dict[str, torch.Tensor]:
    """Every file loaded whole, each MXFP4 tensor dequantized by transformers, in our names."""
    stored = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(str(file)))
    hf_state = {}
    for name, tensor in stored.items():
        if name.endswith("_blocks"):
            scales = stored[name.replace("_blocks", "_scales")]
            hf_state[name.removesuffix("_blocks")] = convert_moe_packed_tensors(tensor, scales)
        elif not name.endswith("_scales"):
            hf_state[name] = tensor
    return adapter.from_hf(hf_state)


def test_read_full_dequantizes_as_transformers_does(checkpoints):
    """hf.read_full (scripts/convert_hf_to_dcp.py) gives transformers' dequantization of every
    MXFP4 tensor exactly (bfloat16), near the weights it was made from."""
    state = hf.read_full(checkpoints.root / "mxfp4", checkpoints.adapter, checkpoints.shapes, None)
    want = reference_import(checkpoints.root / "mxfp4", checkpoints.adapter)
    assert set(state) == set(checkpoints.shapes)
    for name, tensor in state.items():
        assert tensor.dtype == want[name].dtype == torch.bfloat16 and torch.equal(tensor, want[name]), name
    for name in ("layers.0.moe.experts.gate_up", "layers.1.moe.experts.down"):
        original = checkpoints.exported[checkpoints.adapter.to_hf_name(name)]
        step = original.abs().amax() / 4  # FP4's coarsest step, relative to a block's largest value
        assert 0 < (state[name].float() - original).abs().max() <= step, name


@pytest.mark.filterwarnings("ignore:Parallelize plan key")
def test_each_expert_parallel_rank_reads_only_its_experts(checkpoints, monkeypatch):
    """Two ranks at EP 2 (FSDP 2) simulated in turn: each gets the reference's values of its shard
    and reads of the blocks and scales only those of its experts."""
    config = load_config([*TINY, "--model.name", "gpt_oss", "--parallelism.expert_parallel_degree", "2"])
    dims = ParallelDims.from_config(config.parallelism, 2)
    full = reference_import(checkpoints.root / "mxfp4", checkpoints.adapter)
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
            hf.load_into(parts, checkpoints.adapter, checkpoints.root / "mxfp4")
            params = {original_name(n): p for part in parts for n, p in part.named_parameters()}
        finally:
            dist.destroy_process_group()
        packed = Counter()
        for hf_name, _, count in reads:
            if hf_name.endswith(("_blocks", "_scales")):
                packed[hf_name] += count
        for name, param in params.items():
            local = param.to_local() if isinstance(param, DTensor) else param
            want = full[name].float()
            if isinstance(param, DTensor):
                want = distribute_tensor(
                    want, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
            assert torch.equal(local, want), (rank, name)
            if name.endswith(("experts.gate_up", "experts.down")):
                hf_name = checkpoints.adapter.to_hf_name(name)
                assert packed[f"{hf_name}_blocks"] == local.numel() // 2, (rank, name)  # two values a byte
                assert packed[f"{hf_name}_scales"] == local.numel() // mxfp4.VALUES_PER_BLOCK, (rank, name)


SCALES = "model.layers.0.mlp.experts.down_proj_scales"  # (8, 64, 1): 64 rows of one block of 32


def drop_scales(tensors: dict) -> None:
    tensors.pop(SCALES, None)


def cut_scales(tensors: dict) -> None:
    if SCALES in tensors:
        tensors[SCALES] = tensors[SCALES][:, :32].clone()


def rename_scales(tensors: dict) -> None:
    if SCALES in tensors:
        tensors[SCALES.replace("down_proj", "downs_proj")] = tensors.pop(SCALES)


@pytest.mark.parametrize(
    "change, expected",
    [
        (drop_scales, r"down_proj_blocks is MXFP4 without the \S+down_proj_scales scaling it"),
        (
            cut_scales,
            r"down_proj_scales is \(8, 32, 1\), but \S+ \(8, 64, 1, 16\) has \(8, 64, 1\) blocks of 32",
        ),
        (rename_scales, r"downs_proj_scales scales \S+downs_proj_blocks, which the checkpoint lacks"),
    ],
    ids=["blocks without scales", "scales of other blocks", "scales without their blocks"],
)
def test_unusable_mxfp4_tensors_are_the_users_to_fix(checkpoints, tmp_path, change, expected):
    folder = rewritten(checkpoints.root / "mxfp4", tmp_path, change)
    with pytest.raises(UserError, match=expected):
        hf.read_full(folder, checkpoints.adapter, checkpoints.shapes, None)
