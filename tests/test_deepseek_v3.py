"""The DeepSeek-V3 family (models/deepseek_v3/): published shapes, YaRN, and equal logits with
transformers' DeepseekV3ForCausalLM and DeepseekV2ForCausalLM for each routing they implement."""

import logging

import pytest
import torch
import transformers
from conftest import REPO

from checkpoint import hf
from configs import UserError
from models import get_model_spec
from models.rope import Yarn, attention_temperature, rope_amplitude, rope_frequencies
from models.spec import model_args
from training.weight_init import init_weights

SPEC = get_model_spec("deepseek_v3")


def counted_from_config(a) -> tuple[int, int]:
    """(total without MTP, active) parameters of a flavor, counted from its fields alone."""
    heads, qk = a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
    if a.q_lora_rank:
        query = a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * qk
    else:
        query = a.dim * heads * qk
    latent = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    attention = query + latent + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
    attention += heads * a.v_head_dim * a.dim + 2 * a.dim  # output projection, the block's two norms
    dense = 3 * a.dim * a.ffn_hidden_dim
    shared = a.n_experts * a.dim + 3 * a.dim * a.shared_hidden_dim  # router, shared experts
    routed, chosen = 3 * a.dim * a.expert_hidden_dim * a.n_experts, 3 * a.dim * a.expert_hidden_dim * a.top_k
    ends = 2 * a.vocab_size * a.dim + a.dim  # embedding, output, final norm
    moe_layers = a.n_layers - a.first_k_dense
    base = ends + a.n_layers * attention + a.first_k_dense * dense + moe_layers * shared
    return base + moe_layers * routed, base + moe_layers * chosen


@pytest.mark.parametrize(
    "flavor, published_total",
    # DeepSeek-V2-Lite 15.7 B, DeepSeek-V2 236 B, DeepSeek-V3 671 B (685 B with its MTP module),
    # Moonlight 16 B, Kimi K2 1.04 T.
    [("16B", 15.7e9), ("moonlight_16B_A3B", 16e9), ("236B", 236e9), ("671B", 671e9), ("kimi_k2", 1.04e12)],
)
def test_published_shapes_have_their_parameter_counts(flavor, published_total):
    """The model's parameters (without the MTP modules) and active ones are those its config's fields
    give, and the total is the published one."""
    args = SPEC.flavors[flavor]
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    main = sum(p.numel() for name, p in model.named_parameters() if not _is_mtp(name, args))
    assert (main, model.active_parameters(mtp=False)) == counted_from_config(args)
    assert main == pytest.approx(published_total, rel=0.015)
    assert (main != sum(p.numel() for p in model.parameters())) == (args.mtp_depth > 0)


def _is_mtp(name: str, args) -> bool:
    return name.startswith("layers.") and int(name.split(".")[1]) >= args.n_layers


@pytest.mark.parametrize(
    "yarn",
    [
        Yarn(40.0, 4096, 32.0, 1.0, 1.0, 1.0),  # DeepSeek-V3
        Yarn(40.0, 4096, 32.0, 1.0, 0.707, 0.707),  # DeepSeek-V2
        Yarn(32.0, 4096, 1.0, 1.0, 1.0, 1.0),  # Kimi K2
        Yarn(32.0, 4096, 32.0, 1.0, 0.0, 0.0),  # gpt-oss style: no mscale given
        Yarn(2.0, 64, 32.0, 1.0, 0.9, 0.7),  # mscale and mscale_all_dim apart
    ],
)
def test_yarn_equals_transformers(yarn):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": yarn.factor,
                  "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
                  "original_max_position_embeddings": yarn.original_seq_len}  # fmt: skip
    if yarn.mscale:
        parameters |= {"mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim}
    config = transformers.DeepseekV3Config(rope_parameters=parameters, max_position_embeddings=163840)
    frequencies, amplitude = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(rope_frequencies(64, 10000.0, yarn), frequencies, rtol=1e-6, atol=0)
    assert rope_amplitude(yarn) == pytest.approx(amplitude, rel=1e-12)
    assert attention_temperature(yarn) == pytest.approx(yarn_apply_mscale(parameters, 1.0), rel=1e-12)
    assert rope_frequencies(64, 10000.0, Yarn(1.0)).equal(rope_frequencies(64, 10000.0))


def tiny_model(changes: list[str], seq: int = 64):
    args = model_args(SPEC, "tiny", seq, 258, changes)
    model = SPEC.model_cls(args)
    with torch.device("meta"):
        template = SPEC.model_cls(args)
    init_weights(model, template, seed=0)
    model.init_buffers()
    return args, model


@pytest.mark.parametrize(
    "changes, transformers_class",
    [
        ([], "DeepseekV3ForCausalLM"),  # sigmoid, groups by their two best experts, an expert bias
        (["q_lora_rank=0", "n_expert_groups=1", "topk_groups=1"], "DeepseekV3ForCausalLM"),  # Moonlight
        (
            ["score_func=softmax", "renormalize=false", "bias_update_rate=0", "group_score=max"],
            "DeepseekV2ForCausalLM",
        ),
        (
            [
                "score_func=softmax",
                "renormalize=false",
                "bias_update_rate=0",
                "n_expert_groups=1",
                "topk_groups=1",
                "q_lora_rank=0",
            ],
            "DeepseekV2ForCausalLM",
        ),  # DeepSeek-V2-Lite
    ],  # fmt: skip
)
def test_logits_equal_transformers(changes, transformers_class, tmp_path):
    """The export loads with no missing key (unexpected: only the MTP layer's) and gives our logits,
    YaRN on (the tiny flavor stretches a 16-token context to the 64 here)."""
    torch.manual_seed(0)
    args, model = tiny_model(changes)
    state = {name: p.detach() for name, p in model.named_parameters()}
    for name, tensor in state.items():
        if ".moe." in name:  # sharper routing, larger expert outputs: wrong routing would show
            tensor.mul_(5)
    for name, bias in model.named_buffers():
        if name.endswith("expert_bias"):
            if args.bias_update_rate:  # a bias that changes which experts are chosen
                bias.copy_(torch.randn_like(bias) * 0.1)
            state[name] = bias
    hf.save(state, SPEC.adapter(args), tmp_path / "hf", torch.float32, hf_assets_path="")
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True
        )
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    # Nothing to warn about (e.g. no RoPE key of config.json unread) but the MTP layer's keys.
    assert all("LOAD REPORT" in record.getMessage() for record in logged), [r.getMessage() for r in logged]
    assert type(theirs).__name__ == transformers_class
    mtp_layer = f"model.layers.{args.n_layers}."
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(key.startswith(mtp_layer) for key in info["unexpected_keys"])
    theirs.eval()
    tokens = torch.randint(0, 258, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            ["score_func=softmax"],
            "DeepseekV2ForCausalLM (softmax routing) cannot route as this model does "
            "(renormalized gates, an expert bias, groups ranked by their two best experts)",
        ),
        (["group_score=max"], "DeepseekV3ForCausalLM cannot route as this model does (group_score 'max')"),
        (["shared_hidden_dim=48"], "shared_hidden_dim 48 is not a whole number of experts"),
    ],  # fmt: skip
)
def test_routing_no_transformers_class_computes_is_refused_on_export(changes, expected):
    args = model_args(SPEC, "tiny", 64, 258, changes)
    with pytest.raises(UserError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        SPEC.adapter(args).hf_config("float32")


def test_multi_token_prediction_returns_each_depths_logits():
    """With the tokens ahead the forward returns the main logits and each depth's; without them the
    main logits alone, the same either way (the MTP modules change nothing upstream)."""
    _, model = tiny_model(["mtp_depth=2"], seq=32)
    tokens = torch.randint(0, 258, (2, 33))
    ahead = torch.stack([tokens[:, 1:33], torch.roll(tokens, -2, dims=1)[:, :32]], dim=1)
    with torch.no_grad():
        main = model(tokens[:, :32])
        depths = model(tokens[:, :32], mtp_tokens=ahead)
    assert len(depths) == 3 and all(d.shape == main.shape for d in depths)
    assert depths[0].equal(main) and not depths[1].equal(depths[2])


def test_context_parallel_gathers_the_latent_not_keys_and_values():
    """A CP rank's MLA gathers each token's latent (kv_lora_rank + RoPE dims values) where plain CP
    gathers every head's key and value, and its queries' attention equals the whole sequence's."""
    from parallelisms.context_parallel import (
        ContextParallelLatentAttention,
        WholeSequenceExchange,
        local_positions,
    )

    torch.manual_seed(0)
    args, model = tiny_model([], seq=32)
    attention = model.layers["0"].attention
    x = torch.randn(2, 32, args.dim)
    seen = {}
    attention.kernel.register_forward_hook(lambda _, inputs, __: seen.update(latent=inputs[1].detach()))
    with torch.no_grad():
        whole = attention(x, model.rope_cos, model.rope_sin)
        keys, values = attention.expand(seen["latent"])
    rank, degree = 1, 2
    positions = local_positions(32, rank, degree)
    sent = []

    class Recorded(WholeSequenceExchange):
        def start_gather(self, local):
            sent.append(local.shape)
            return super().start_gather(local)

    attention.kernel = ContextParallelLatentAttention(
        Recorded(seen["latent"].unsqueeze(0).unsqueeze(2), rank, degree)
    )
    with torch.no_grad():
        mine = attention(x[:, positions], model.rope_cos[positions], model.rope_sin[positions])
    torch.testing.assert_close(mine, whole[:, positions], rtol=1e-5, atol=1e-6)
    # What this rank sends: its 16 tokens' latents, one "head" of kv_lora_rank + rope dims values.
    assert sent == [torch.Size([1, 2, 1, 16, args.kv_lora_rank + args.qk_rope_head_dim])]
    per_token = {"latent": args.kv_lora_rank + args.qk_rope_head_dim,
                 "keys and values": keys.shape[1] * (keys.shape[-1] + values.shape[-1])}  # fmt: skip
    assert per_token == {"latent": 16 + 8, "keys and values": 4 * (24 + 12)}


@pytest.mark.slow
def test_dry_run_fits_671b_and_kimi_k2_on_1024_and_2048_gpus_of_80_gb():
    """configs/deepseek_v3_671b.toml's layout (PP 8 x FSDP 128 with EP 64; PP 16 at 2,048 GPUs), for
    DeepSeek-V3 and Kimi K2: every pipeline stage's estimate under 80 GB, each dry run in a minute.
    (Kimi K2, the larger, on both; DeepSeek-V3 at 1,024.)"""
    import time

    from configs import load_config
    from training.dry_run import dry_run

    for flavor, world, stages in (("671B", 1024, 8), ("kimi_k2", 1024, 8), ("kimi_k2", 2048, 16)):
        start = time.perf_counter()
        config = load_config([
            "--config", str(REPO / "configs/deepseek_v3_671b.toml"), "--model.flavor", flavor,
            "--job.dry_run", "--job.dry_run_world_size", str(world),
            "--parallelism.pipeline_parallel_degree", str(stages),
            "--training.global_batch_size", str(world),
        ])  # fmt: skip
        estimate = dry_run(config)
        assert estimate.total_gib < 80 * 1e9 / 2**30, (flavor, world, estimate)
        assert time.perf_counter() - start < 60, (flavor, world)
