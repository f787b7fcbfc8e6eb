"""Llama 3: shapes and parameter counts, RoPE, causality, HF adapter, FLOPs, layout-free init."""

import math

import pytest
import torch

from configs import UserError
from models import get_model_spec
from models.llama3.model import Llama3Args, Transformer, apply_rope, rope_frequencies
from models.llama3.state_dict_adapter import Llama3StateDictAdapter
from models.spec import model_args
from training.weight_init import init_weights, materialize

SPEC = get_model_spec("llama3")


def build(
    flavor: str = "tiny", seq_len: int = 16, seed: int = 0, device: str = "cpu", **changes
) -> Transformer:
    args = model_args(SPEC, flavor, seq_len, 258)
    for key, value in changes.items():
        setattr(args, key, value)
    with torch.device("meta"):
        model, template = Transformer(args), Transformer(args)
    materialize(model, device)
    init_weights(model, template, seed)
    model.init_buffers()
    return model


# Parameter counts of Meta's released checkpoints (Hugging Face model cards / safetensors index).
@pytest.mark.parametrize(
    "flavor, params",
    [("1B", 1_235_814_400), ("3B", 3_212_749_824), ("8B", 8_030_261_248), ("70B", 70_553_706_496),
     ("405B", 405_853_388_800)],
)  # fmt: skip
def test_parameter_counts_match_meta(flavor, params):
    with torch.device("meta"):
        model = Transformer(model_args(SPEC, flavor, 8192, 128256))
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.args.vocab_size == 128256


def test_8b_shapes():
    with torch.device("meta"):
        model = Transformer(model_args(SPEC, "8B", 8192, 128256))
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (4096, 4096)
    assert attention.wk.weight.shape == (1024, 4096)  # 8 kv heads x 128
    assert model.layers["31"].feed_forward.w1.weight.shape == (14336, 4096)
    assert model.output.weight.shape == (128256, 4096)


def test_debug_vocab_follows_tokenizer():
    assert model_args(SPEC, "debugmodel", 64, 258).vocab_size == 320
    assert model_args(SPEC, "debugmodel", 64, 32000).vocab_size == 32000


def test_model_args_change_the_flavor():
    args = model_args(SPEC, "tiny", 16, 258, ["tie_embeddings=true", "n_layers=2", "rope_theta=1e4"])
    assert (args.tie_embeddings, args.n_layers, args.rope_theta, args.dim) == (True, 2, 1e4, 64)
    with pytest.raises(UserError, match=r"'n_layer=2' is not name=value .*did you mean 'n_layers'"):
        model_args(SPEC, "tiny", 16, 258, ["n_layer=2"])
    with pytest.raises(UserError, match="model.args n_layers must be an integer, got 'two'"):
        model_args(SPEC, "tiny", 16, 258, ["n_layers=two"])


def test_forward_shape_and_tied_output():
    model = build(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    logits = model(torch.randint(0, 258, (2, 16)))
    assert logits.shape == (2, 16, 320)


def test_attention_is_causal():
    model = build()
    tokens = torch.randint(0, 258, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 258
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_positions_argument_matches_default_positions():
    model = build()
    tokens = torch.randint(0, 258, (2, 16))
    torch.testing.assert_close(model(tokens), model(tokens, positions=torch.arange(16)))


def test_rope_scaling_matches_reference_loop():
    args = Llama3Args(dim=512, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden_dim=8, vocab_size=8,
                      rope_scaling_factor=8.0)  # fmt: skip
    head_dim = 128
    expected = []
    for i in range(0, head_dim, 2):  # Meta's apply_scaling, written as the straightforward loop
        freq = 1.0 / (args.rope_theta ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        low, high = 8192 / 1.0, 8192 / 4.0
        if wavelen < high:
            expected.append(freq)
        elif wavelen > low:
            expected.append(freq / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * freq / 8.0 + smooth * freq)
    torch.testing.assert_close(rope_frequencies(args), torch.tensor(expected), rtol=1e-5, atol=0)


def test_apply_rope_equals_complex_rotation():
    x = torch.randn(2, 5, 3, 8)
    angles = torch.rand(5, 4) * 6
    expected = torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (4, 2)))
        * torch.polar(torch.ones_like(angles), angles)[None, :, None]
    )
    torch.testing.assert_close(apply_rope(x, angles.cos(), angles.sin()), expected.flatten(-2))


def _rotate_half_rope(x, angles):
    """Hugging Face's convention: rotate the two halves of each head."""
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[None, :, None],
        torch.cat([angles.sin()] * 2, -1)[None, :, None],
    )
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), -1) * sin


def test_hf_adapter_round_trip_and_rope_equivalence():
    model = build()
    args = model.args
    state = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = Llama3StateDictAdapter(args)
    hf = adapter.to_hf(state)
    assert "model.layers.0.self_attn.q_proj.weight" in hf and "lm_head.weight" in hf
    back = adapter.from_hf(hf)
    assert back.keys() == state.keys()
    for key in state:
        torch.testing.assert_close(back[key], state[key], rtol=0, atol=0)
    # Our q (interleaved RoPE) and HF's q (half rotation, permuted weights) give the same scores.
    x = torch.randn(1, 6, args.dim)
    angles = torch.outer(torch.arange(6.0), rope_frequencies(args))
    head_dim = args.dim // args.n_heads
    ours_q = apply_rope(
        (x @ state["layers.0.attention.wq.weight"].T).view(1, 6, -1, head_dim), angles.cos(), angles.sin()
    )
    ours_k = apply_rope(
        (x @ state["layers.0.attention.wk.weight"].T).view(1, 6, -1, head_dim), angles.cos(), angles.sin()
    )
    hf_q = _rotate_half_rope(
        (x @ hf["model.layers.0.self_attn.q_proj.weight"].T).view(1, 6, -1, head_dim), angles
    )
    hf_k = _rotate_half_rope(
        (x @ hf["model.layers.0.self_attn.k_proj.weight"].T).view(1, 6, -1, head_dim), angles
    )
    scores = lambda q, k: torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(2, dim=2))
    torch.testing.assert_close(scores(ours_q, ours_k), scores(hf_q, hf_k), rtol=1e-4, atol=1e-5)


def test_hf_adapter_tied_model_has_no_lm_head():
    model = build(tie_embeddings=True)
    hf = Llama3StateDictAdapter(model.args).to_hf(dict(model.state_dict()))
    assert "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf


def test_flops_per_token_formula():
    with torch.device("meta"):
        model = Transformer(model_args(SPEC, "8B", 8192, 128256))
    matmul_params = 8_030_261_248 - 128256 * 4096
    assert model.flops_per_token(8192) == 6 * matmul_params + 6 * 32 * 8192 * 4096


def test_init_is_seeded():
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
    assert abs(a.tok_embeddings.weight.std().item() - 1.0) < 0.05
    assert abs(a.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.003
    assert torch.all(a.norm.weight == 1)


def test_init_does_not_depend_on_which_parameters_a_rank_holds():
    full = build(seed=3)
    args = full.args
    with torch.device("meta"):
        stage, template = Transformer(args), Transformer(args)
    del stage.layers["0"], stage.layers["1"]  # like a later pipeline stage
    stage.tok_embeddings = None
    stage.layers["2"] = torch.compile(stage.layers["2"])  # wrappers rename parameters (_orig_mod)
    materialize(stage, "cpu")
    init_weights(stage, template, 3)
    full_params = dict(full.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, full_params[name.replace("_orig_mod.", "")]), name


# Qwen3 parameter counts of the official releases (model cards: total; non-embedding excludes the
# embedding and, when untied, the output projection).
@pytest.mark.parametrize(
    "flavor, total, non_embedding",
    [("0.6B", 596_049_920, 0.44e9), ("1.7B", 1_720_574_976, 1.4e9), ("4B", 4_022_468_096, 3.6e9),
     ("8B", 8_190_735_360, 6.95e9), ("14B", 14_768_307_200, 13.2e9), ("32B", 32_762_123_264, 31.2e9)],
)  # fmt: skip
def test_qwen3_parameter_counts(flavor, total, non_embedding):
    spec = get_model_spec("qwen3")
    with torch.device("meta"):
        model = spec.model_cls(model_args(spec, flavor, 4096, 151936))
    count = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel() * (1 if model.args.tie_embeddings else 2)
    assert count == total
    assert (count - embedding) / 1e9 == pytest.approx(non_embedding / 1e9, abs=0.05)  # cards round
    assert model.args.tie_embeddings == (flavor in ("0.6B", "1.7B", "4B"))


def test_qwen3_builds_trains_and_adapts():
    spec = get_model_spec("qwen3")
    args = model_args(spec, "tiny", 16, 258)
    with torch.device("meta"):
        model, template = spec.model_cls(args), spec.model_cls(args)
    materialize(model, torch.device("cpu"))
    init_weights(model, template, 0)
    model.init_buffers()
    logits = model(torch.randint(0, 258, (2, 16)))
    assert logits.shape == (2, 16, 320)
    logits.sum().backward()
    assert model.layers["0"].attention.q_norm.weight.grad is not None
    adapter = spec.state_dict_adapter(args)
    state = dict(model.state_dict())
    hf = adapter.to_hf(state)
    assert "model.layers.0.self_attn.q_norm.weight" in hf
    assert adapter.from_hf(hf).keys() == state.keys()
