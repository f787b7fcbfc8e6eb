"""Mixture of Experts: grouped GEMM, routing, balancing, no dropped token (models/moe.py); the
Qwen3-MoE family's shapes, Hugging Face conversion and a training run."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TINY, read_metrics, run_train
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import models.grouped_experts as grouped_experts
from configs import UserError
from models import get_model_spec
from models.grouped_experts import expert_swiglu
from models.moe import (
    MoE,
    MoEArgs,
    choose_experts,
    load_statistics,
    moe_layers,
    sequence_balance_loss,
    set_sequences_per_step,
    update_expert_bias,
)
from models.spec import model_args
from parallelisms.pipeline import ShapeInferenceCounts
from training.expert_balance import ExpertBalance
from training.memory_estimate import ACTIVATION_BYTES_PER_FFN

SPEC = get_model_spec("qwen3_moe")


def layer(seed: int = 0, dim: int = 16, **changes) -> MoE:
    """An MoE layer with seeded weights (normal, so that routing differs visibly between tokens)."""
    args = MoEArgs(**{"n_experts": 8, "top_k": 2, "expert_hidden_dim": 32, **changes})
    torch.manual_seed(seed)
    moe = MoE(dim, args)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    moe.init_buffers()
    return moe


# ---- Expert computation ----


def _expert_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    counts = torch.tensor([6, 0, 9, 0, 5])  # experts 1 and 3 get no token
    tokens = torch.randn(int(counts.sum()), 16, dtype=dtype)
    weights = [torch.randn(5, 16, 32, dtype=dtype), torch.randn(5, 32, 16, dtype=dtype),
               torch.randn(5, 16, 32, dtype=dtype)]  # fmt: skip
    return tokens, counts, weights


def _run_experts(tokens, counts, weights, grad_out):
    leaves = [t.clone().requires_grad_() for t in (tokens, *weights)]
    out = expert_swiglu(leaves[0], counts, *leaves[1:])
    out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in leaves]


def test_grouped_gemm_equals_the_per_expert_loop(monkeypatch):
    tokens, counts, weights = _expert_inputs()
    assert grouped_experts.grouped_mm_runs(tokens, *weights)  # fp32 on CPU: the grouped path runs
    grad_out = torch.randn(tokens.shape[0], 16)
    grouped, grouped_grads = _run_experts(tokens, counts, weights, grad_out)
    monkeypatch.setattr(grouped_experts, "grouped_mm_runs", lambda *tensors: False)
    looped, looped_grads = _run_experts(tokens, counts, weights, grad_out)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)
    for mine, reference in zip(grouped_grads, looped_grads):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    for grad in grouped_grads[1:]:  # experts without tokens get exactly zero gradient
        assert torch.all(grad[[1, 3]] == 0)


def test_grouped_gemm_backward_takes_a_zero_stride_gradient():
    tokens, counts, weights = _expert_inputs()
    leaves = [w.clone().requires_grad_() for w in weights]
    expert_swiglu(tokens, counts, *leaves).sum().backward()  # sum's gradient has stride 0
    assert leaves[0].grad.abs().sum() > 0


def test_grouped_gemm_is_used_only_where_torch_runs_it():
    tokens, _, weights = _expert_inputs()
    assert grouped_experts.grouped_mm_runs(tokens.bfloat16(), *(w.bfloat16() for w in weights))
    assert not grouped_experts.grouped_mm_runs(tokens.double(), *(w.double() for w in weights))
    assert not grouped_experts.grouped_mm_runs(tokens[:, :15], *weights)  # 60-byte rows: not aligned


@pytest.mark.slow
def test_layer_compiles_as_one_graph_where_the_loop_runs():
    """fp32 under torch.compile takes the loop (torch._grouped_mm compiles in bf16 only); blocks are
    compiled with fullgraph, which the loop's custom ops keep possible. Same values as eager."""
    moe = layer(shared_hidden_dim=16, aux_loss_coeff=0.1)
    x = torch.randn(2, 8, 16, requires_grad=True)
    moe(x).pow(2).sum().backward()
    eager = [moe(x).detach(), moe.experts.w1.grad.clone(), moe.router.weight.grad.clone()]
    moe.zero_grad()
    moe.compile(fullgraph=True)
    out = moe(x)
    out.pow(2).sum().backward()
    for compiled, reference in zip([out, moe.experts.w1.grad, moe.router.weight.grad], eager):
        torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=1e-5)


# ---- Routing ----


def test_bias_changes_the_choice_but_not_the_gate_values():
    args = MoEArgs(n_experts=4, top_k=1, expert_hidden_dim=8, renormalize=False)
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    experts, gates = choose_experts(scores, torch.zeros(4), args)
    assert experts.tolist() == [[0]] and gates.item() == pytest.approx(0.4)
    experts, gates = choose_experts(scores, torch.tensor([0.0, 0.0, 0.0, 0.5]), args)
    assert experts.tolist() == [[3]] and gates.item() == pytest.approx(0.1)  # the score, unbiased


def test_group_limited_routing_picks_only_from_the_best_groups():
    args = MoEArgs(n_experts=16, top_k=3, expert_hidden_dim=8, n_expert_groups=4, topk_groups=2,
                   score_func="sigmoid")  # fmt: skip
    torch.manual_seed(0)
    scores, bias = torch.rand(200, 16), torch.randn(16) * 0.1
    experts, _ = choose_experts(scores, bias, args)
    choice = scores + bias
    for token in range(200):
        group_scores = choice[token].view(4, 4).topk(2).values.sum(-1)
        best = set(group_scores.topk(2).indices.tolist())
        allowed = torch.cat([choice[token].view(4, 4)[g] for g in sorted(best)])
        chosen = set(experts[token].tolist())
        assert {e // 4 for e in chosen} <= best
        assert sorted(choice[token, sorted(chosen)].tolist()) == sorted(allowed.topk(3).values.tolist())


def test_ties_route_to_the_lower_index_the_same_way_for_every_token():
    args = MoEArgs(n_experts=8, top_k=3, expert_hidden_dim=8, n_expert_groups=4, topk_groups=2)
    scores = torch.full((5, 8), 0.125)
    experts, gates = choose_experts(scores, torch.zeros(8), args)
    assert experts.tolist() == [[0, 1, 2]] * 5  # groups 0 and 1 tie with 2 and 3: the lower win
    torch.testing.assert_close(gates, torch.full((5, 3), 1 / 3))
    scores[:, 5] = 0.5  # a clear winner first, then ties in index order
    assert choose_experts(scores, torch.zeros(8), args)[0].tolist() == [[5, 0, 1]] * 5


def test_no_token_is_dropped_each_output_is_its_experts_weighted_sum():
    moe = layer(score_func="sigmoid", route_scale=2.5, n_expert_groups=4, topk_groups=2, shared_hidden_dim=8)
    moe.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(3, 10, 16)
    out = moe(x)
    tokens = x.reshape(-1, 16)
    _, experts, gates = moe.route(tokens)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(tokens.shape[0]):
        expected = moe.shared_experts(tokens[t])
        for expert, gate in zip(experts[t].tolist(), gates[t]):
            expected = expected + gate * (
                (F.silu(tokens[t] @ w1[expert]) * (tokens[t] @ w3[expert])) @ w2[expert]
            )
        torch.testing.assert_close(out.reshape(-1, 16)[t], expected, rtol=1e-4, atol=1e-5)


# ---- Load balancing ----


def test_counts_accumulate_over_training_forwards_only():
    moe = layer()
    x = torch.randn(2, 8, 16)
    moe(x)
    moe(x)
    assert moe.tokens_per_expert.sum().item() == 2 * 16 * 2  # two forwards of 16 tokens x top-2
    with torch.no_grad():
        moe(x)  # evaluation
    moe.eval()
    moe(x)
    assert moe.tokens_per_expert.sum().item() == 64
    moe.train()
    with set_checkpoint_early_stop(False):  # activation checkpointing re-runs the whole forward
        checkpoint(moe, x.requires_grad_(), use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 96


def test_pipeline_first_step_counts_only_the_micro_batches_even_after_a_nan_forward():
    """torch.distributed.pipelining's shape inference runs a stage on empty tensors first (whatever
    memory held: NaN here); the first step's statistics are then the micro-batches' alone."""
    stage, reference = torch.nn.Sequential(layer(aux_loss_coeff=1e-3)), layer(aux_loss_coeff=1e-3)
    micro_batches = [torch.randn(2, 8, 16) for _ in range(2)]
    watch = ShapeInferenceCounts([stage])
    stage(torch.full((2, 8, 16), float("nan")))  # the shape inference forward
    for x in micro_batches:
        stage(x)
        reference(x)
    assert stage[0].aux_loss.isnan()  # what it added is in the buffers until take_back
    watch.take_back(n_microbatches=2)
    assert torch.equal(stage[0].tokens_per_expert, reference.tokens_per_expert)
    assert stage[0].aux_loss.item() == pytest.approx(reference.aux_loss.item(), rel=1e-6)
    assert not watch.hooks  # later steps run unwatched


def test_update_expert_bias_moves_towards_balance_and_stays_zero_mean():
    moe = layer(score_func="sigmoid")  # DeepSeek-V3's scores, on whose scale the bias moves
    update_expert_bias(moe, torch.tensor([10, 0, 5, 5, 5, 5, 5, 5]), coeff=0.01)
    assert moe.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0], abs=1e-7)
    moe.expert_bias.zero_()
    moe.router.weight.data[0] = 0.3  # expert 0 wins for nearly every token of x
    torch.manual_seed(1)
    x = torch.randn(8, 32, 16) + 1
    with torch.no_grad():
        before = load_statistics(torch.bincount(moe.route(x.reshape(-1, 16))[1].flatten(), minlength=8))
    for _ in range(100):
        moe.tokens_per_expert.zero_()
        moe(x)
        update_expert_bias(moe, moe.tokens_per_expert, coeff=0.02)
        assert abs(moe.expert_bias.mean().item()) < 1e-6
    after = load_statistics(moe.tokens_per_expert)
    assert before["max_load"] == 4.0 and after["max_load"] < 1.3, (before, after)
    assert moe.expert_bias[0] == moe.expert_bias.min()


def test_bias_update_lets_a_running_save_take_its_copies_first():
    """The biases are saved state changed in place after the optimizer step, which a non-finite
    step may skip (and with it the pre-hook that takes a running save's copies over)."""
    model = torch.nn.ModuleDict({"moe": layer(score_func="sigmoid", bias_update_rate=0.01)})
    model["moe"](torch.randn(2, 8, 16))  # counts for the update
    seen = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        balance = ExpertBalance(
            [model], dist.group.WORLD, None, lambda: seen.append(model["moe"].expert_bias.clone())
        )
        balance.after_step()
    finally:
        dist.destroy_process_group()
    assert len(seen) == 1 and not seen[0].any()  # called once, before the biases moved
    assert model["moe"].expert_bias.any()


def test_load_statistics():
    assert load_statistics(torch.tensor([4, 0, 2, 2])) == {
        "max_load": 2.0,
        "min_load": 0.0,
        "idle_experts": 1,
    }
    assert load_statistics(torch.zeros(4)) == {"max_load": 0.0, "min_load": 0.0, "idle_experts": 4}


def _router_and_input_grads(moe: MoE, x: torch.Tensor, upstream: torch.Tensor, extra_loss=None):
    moe.zero_grad()
    x = x.clone().requires_grad_()
    out = moe(x)
    loss = (out * upstream).sum()
    if extra_loss is not None:
        loss = loss + extra_loss(moe, x)
    loss.backward()
    return moe.router.weight.grad.clone(), x.grad


def test_aux_loss_gradient_equals_autograd_of_the_explicit_objective():
    coeff = 0.3
    with_aux = layer(seed=1, aux_loss_coeff=coeff, score_func="sigmoid")
    without = layer(seed=1, score_func="sigmoid")
    x, upstream = torch.randn(3, 12, 16), torch.randn(3, 12, 16)

    def explicit_aux(moe, x):
        scores, experts, _ = moe.route(x.reshape(-1, 16))
        return coeff * sequence_balance_loss(scores.view(3, 12, 8), experts.view(3, 12, 2), "sigmoid").mean()

    got = _router_and_input_grads(with_aux, x, upstream)
    want = _router_and_input_grads(without, x, upstream, explicit_aux)
    for mine, reference in zip(got, want):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got[0], _router_and_input_grads(without, x, upstream)[0])  # the aux counts
    scores, experts, _ = with_aux.route(x.reshape(-1, 16))
    expected_value = sequence_balance_loss(scores.view(3, 12, 8), experts.view(3, 12, 2), "sigmoid").sum()
    assert with_aux.aux_loss.item() == pytest.approx(expected_value.item())  # summed over the sequences


def test_aux_loss_is_the_mean_over_the_steps_sequences_however_they_are_split():
    """One micro-batch of 4 sequences, or two of 2 told that the step holds 4: the same gradient."""
    moe = layer(seed=2, aux_loss_coeff=1.0)
    x, upstream = torch.randn(4, 8, 16), torch.zeros(4, 8, 16)  # the aux loss alone
    whole = _router_and_input_grads(moe, x, upstream)[0]
    set_sequences_per_step(moe, 4)
    halves = sum(_router_and_input_grads(moe, x[i : i + 2], upstream[:2])[0] for i in (0, 2))
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-7)


def test_balance_loss_is_one_when_balanced():
    scores = torch.full((1, 4, 4), 0.25)
    experts = torch.tensor([[[0], [1], [2], [3]]])
    assert sequence_balance_loss(scores, experts, "softmax").item() == pytest.approx(1.0)


# ---- Qwen3-MoE ----


def meta_model(flavor: str):
    with torch.device("meta"):
        return SPEC.model_cls(model_args(SPEC, flavor, 4096, 151936))


# Model cards: Qwen3-30B-A3B "30.5B in total and 3.3B activated, 29.9B non-embedding";
# Qwen3-235B-A22B "235B in total and 22B activated, 234B non-embedding".
@pytest.mark.parametrize(
    "flavor, total, active, card_total, card_active, card_non_embedding, digits",
    [("30B-A3B", 30_532_122_624, 3_353_032_704, 30.5, 3.3, 29.9, 1),
     ("235B-A22B", 235_093_634_560, 22_190_763_520, 235, 22, 234, 0)],
)  # fmt: skip
def test_qwen3_moe_parameter_counts(
    flavor, total, active, card_total, card_active, card_non_embedding, digits
):
    model = meta_model(flavor)
    count = sum(p.numel() for p in model.parameters())
    embedding = 2 * model.tok_embeddings.weight.numel()  # untied: embedding and output
    assert (count, model.active_parameters()) == (total, active)
    assert round(count / 1e9, digits) == card_total
    assert round((count - embedding) / 1e9, digits) == card_non_embedding
    assert math.floor(active / 1e9 * 10**digits) / 10**digits == card_active  # 3.35 is "3.3B" there


def test_qwen3_moe_flops_count_active_parameters():
    model = meta_model("30B-A3B")
    matmul = 3_353_032_704 - 151936 * 2048  # active parameters without the embedding table
    assert model.flops_per_token(4096) == 6 * matmul + 6 * 48 * 4096 * 32 * 128


@pytest.mark.parametrize(
    "changes, message",
    [(["top_k=9"], "top_k 9 is more than n_experts 8"),
     (["n_expert_groups=3"], "n_experts 8 must be divisible by n_expert_groups 3"),
     (["n_expert_groups=4", "topk_groups=5"], "topk_groups 5 must be between 1 and n_expert_groups 4"),
     (["n_expert_groups=4", "top_k=5"], "top_k 5 is more than the 2 experts of topk_groups 1"),
     (["score_func=relu"], "score_func 'relu' is not one of softmax, sigmoid")],
)  # fmt: skip
def test_impossible_moe_shapes_are_one_error_line(changes, message):
    with pytest.raises(UserError, match=message) as error:
        model_args(SPEC, "tiny", 16, 258, changes)
    assert "\n" not in str(error.value)


def test_moe_option_on_a_dense_model_is_one_error_line():
    with pytest.raises(UserError, match="'n_experts' is a Mixture-of-Experts option and Llama3Args has no"):
        model_args(get_model_spec("llama3"), "tiny", 16, 258, ["n_experts=8"])


def test_every_block_has_one_moe_layer_with_seeded_full_expert_tensors():
    from training.weight_init import init_weights, materialize

    args = model_args(SPEC, "tiny", 16, 258)
    with torch.device("meta"):
        model, template = SPEC.model_cls(args), SPEC.model_cls(args)
    materialize(model, torch.device("cpu"))
    init_weights(model, template, seed=3)
    model.init_buffers()
    layers = moe_layers(model)
    assert list(layers) == ["layers.0.moe", "layers.1.moe"]
    w1 = layers["layers.0.moe"].experts.w1
    assert w1.shape == (8, 64, 32) and abs(w1.std().item() - 0.02) < 0.003
    assert torch.all(layers["layers.0.moe"].expert_bias == 0)
    assert "layers.0.moe.expert_bias" in model.state_dict()  # saved with checkpoints
    assert "layers.0.moe.tokens_per_expert" not in model.state_dict()


@pytest.mark.slow
def test_debug_flavor_trains(tmp_path):
    run = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel", "--training.steps", "8"]
    run_train([*TINY, *run, "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
    losses = [record["loss"] for record in read_metrics(tmp_path)]
    assert losses[-1] < losses[0] - 1.5, losses
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "checkpoint/step-8")).read_metadata().state_dict_metadata
    assert "model.layers.3.moe.expert_bias" in saved and "model.layers.3.moe.experts.w2" in saved
    # Through Hugging Face files and back to a DCP folder (parameters only: no expert bias there),
    # which then starts another run.
    from test_hf import script

    hf_folder, dcp_folder = tmp_path / "hf", tmp_path / "from_hf"
    step8 = str(tmp_path / "checkpoint/step-8")
    script("convert_dcp_to_hf.py", "--checkpoint", step8, "--output", str(hf_folder), "--dtype", "float32")
    script("convert_hf_to_dcp.py", "--hf", str(hf_folder), "--config", str(tmp_path / "config.toml"),
           "--output", str(dcp_folder))  # fmt: skip
    start = ["--checkpoint.initial_load_path", str(dcp_folder), "--training.steps", "1"]
    run_train([*TINY, *run[:4], *start, "--job.dump_folder", str(tmp_path / "restart")])
    assert read_metrics(tmp_path / "restart")[0]["loss"] < losses[0] - 1.5  # it started from the weights


# ---- Memory estimate (training/memory_estimate.py) ----


def dry_run_estimate(world: int, *overrides: str):
    """The memory estimate of rank 0 of `world` ranks: a dry run, in this process (fake process group)."""
    from configs import load_config
    from training.dry_run import dry_run

    return dry_run(load_config([*TINY, "--job.dry_run", "--job.dry_run_world_size", str(world), *overrides]))


@pytest.mark.parametrize("ep, tp", [(8, 1), (4, 4)])
def test_memory_estimate_gathers_only_this_ranks_experts(ep, tp):
    """Qwen3-MoE 235B-A22B on 64 ranks: FSDP gathers a block's attention (its TP slice), norms and
    router, and the n_experts / ep routed experts this rank holds (TP replicates experts and router)."""
    layers, seq = 4, 4096  # fewer layers than the flavor's 94: the same blocks, built faster
    run = ["--model.name", "qwen3_moe", "--model.flavor", "235B-A22B", "--model.args", f"n_layers={layers}",
           "--training.seq_len", str(seq), "--training.local_batch_size", "1",
           "--parallelism.tensor_parallel_degree", str(tp)]  # fmt: skip
    estimate = dry_run_estimate(64, *run, "--parallelism.expert_parallel_degree", str(ep))
    all_experts = dry_run_estimate(64, *run)  # no expert parallelism
    args = model_args(SPEC, "235B-A22B", seq, 151936)
    attention = args.dim * args.head_dim * 2 * (args.n_heads + args.n_kv_heads)  # wq, wo; wk, wv
    norms = 2 * args.dim + 2 * args.head_dim  # attention_norm, ffn_norm; q_norm, k_norm
    router, expert = args.n_experts * args.dim, 3 * args.dim * args.expert_hidden_dim  # expert: w1, w2, w3
    # Two blocks (prefetch) in bf16. FSDP's 64 / tp ranks (experts: 64 / tp / ep) divide every
    # tensor's first dimension, so nothing is padded.
    block = attention // tp + norms + router
    assert estimate.gathered_gib * 2**30 == 2 * 2 * (block + args.n_experts // ep * expert)
    assert all_experts.gathered_gib * 2**30 == 2 * 2 * (block + args.n_experts * expert)
    assert estimate.gathered_gib < all_experts.gathered_gib
    # Activations: per layer the top_k routed experts' width, not split by TP (the logits are), and
    # the same whatever the EP degree.
    per_layer = ACTIVATION_BYTES_PER_FFN * args.top_k * args.expert_hidden_dim
    expected = seq * (layers * per_layer + 6 * args.vocab_size / tp)
    assert estimate.activations_gib * 2**30 == all_experts.activations_gib * 2**30 == pytest.approx(expected)


@pytest.mark.parametrize("tp", [1, 8])
def test_memory_estimate_of_a_dense_model_is_unchanged(tp):
    """Llama 3 8B on 64 ranks: the previous formulas (a block's parameters / tp, gathered twice in
    bf16; activations per ffn unit / tp), but norms, which TP replicates, are gathered whole."""
    estimate = dry_run_estimate(64, "--model.flavor", "8B", "--parallelism.tensor_parallel_degree", str(tp))
    args = model_args(get_model_spec("llama3"), "8B", 32, 128256)  # tests/tiny.toml: seq_len 32, batch 4
    with torch.device("meta"):
        block = get_model_spec("llama3").model_cls(args).layers["0"]
    previous = 2 * 2 * sum(p.numel() for p in block.parameters()) / tp
    replicated_norms = 2 * 2 * 2 * args.dim * (1 - 1 / tp)  # attention_norm, ffn_norm: whole, not / tp
    assert estimate.gathered_gib * 2**30 == pytest.approx(previous + replicated_norms, rel=1e-12)
    per_layer = ACTIVATION_BYTES_PER_FFN * args.ffn_hidden_dim / tp
    expected = (args.n_layers * per_layer + 6 * args.vocab_size / tp) * 4 * 32
    assert estimate.activations_gib * 2**30 == pytest.approx(expected)


# ---- Hugging Face conversion ----


def seeded_tiny(seed: int = 7):
    from test_hf import seeded_model

    args = model_args(SPEC, "tiny", 32, 258)
    return args, {name: p.detach() for name, p in seeded_model(args, SPEC).named_parameters()}


def test_hf_names_split_stacked_experts_and_come_back():
    args, state = seeded_tiny()
    adapter = SPEC.state_dict_adapter(args)
    hf_state = adapter.to_hf(state)
    w1 = state["layers.1.moe.experts.w1"]  # (experts, dim, hidden)
    assert torch.equal(hf_state["model.layers.1.mlp.experts.7.gate_proj.weight"], w1[7].T)
    assert hf_state["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert torch.equal(hf_state["model.layers.0.mlp.gate.weight"], state["layers.0.moe.router.weight"])
    assert len(hf_state) == len(state) + 2 * 3 * (8 - 1)  # 3 stacked tensors per layer, 8 experts each
    back = adapter.from_hf(hf_state)
    assert back.keys() == state.keys() and all(torch.equal(back[n], state[n]) for n in state)


@pytest.mark.filterwarnings("ignore:Parallelize plan key")
def test_each_rank_reads_only_its_experts(tmp_path, monkeypatch):
    """FSDP 4 x TP 2, simulated rank by rank: FSDP shards the stacked experts (replicated over TP) by
    expert, and each rank reads the Hugging Face tensors of its 2 experts of 8, and no other."""
    import functools
    from collections import Counter

    import torch.distributed as dist
    from conftest import REPO
    from test_hf import counting_safe_open
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from checkpoint import hf
    from configs import load_config
    from parallelisms import ParallelDims
    from parallelisms.wrapper_names import original_name
    from training.model_setup import build_model
    from training.weight_init import materialize

    overrides = ["--model.name=qwen3_moe", "--parallelism.data_parallel_shard_degree=4",
                 "--parallelism.tensor_parallel_degree=2"]  # fmt: skip
    config = load_config(["--config", str(REPO / "configs/llama3_debug.toml"), *TINY, *overrides])
    dims = ParallelDims.from_config(config.parallelism, 8)
    args, full = seeded_tiny()
    adapter = SPEC.state_dict_adapter(args)
    hf.save(full, adapter, tmp_path / "hf", torch.float32, hf_assets_path="")
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        _clear_sharding_prop_cache()  # the meshes of two simulated ranks compare equal
        try:
            parts = build_model(
                config, dims, dims.build_mesh("cpu"), torch.device("cpu"), initialize=False
            ).parts
            materialize(parts[0], torch.device("cpu"))
            reads = Counter()
            monkeypatch.setattr(hf, "safe_open", functools.partial(counting_safe_open, reads))
            hf.load_into(parts, adapter, tmp_path / "hf")
            shard = rank // 2  # ranks are (FSDP shard, TP rank); FSDP shard s holds experts 2s, 2s + 1
            stacked = [f"layers.{layer}.moe.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]
            mine = {adapter.to_hf_name(name, e) for name in stacked for e in (2 * shard, 2 * shard + 1)}
            assert {name for name in reads if ".mlp.experts." in name} == mine, rank
            assert all(reads[name] == 64 * 32 for name in mine)  # each of them once, whole
            for name, param in parts[0].named_parameters():
                name = original_name(name)
                want = distribute_tensor(full[name], param.device_mesh, param.placements, src_data_rank=None)
                assert torch.equal(param.to_local(), want.to_local()), (rank, name)
        finally:
            dist.destroy_process_group()


def test_hf_import_refuses_a_missing_expert(tmp_path):
    from safetensors.torch import save_file

    from checkpoint import hf

    args, state = seeded_tiny()
    adapter = SPEC.state_dict_adapter(args)
    hf_state = {name: t.contiguous() for name, t in adapter.to_hf(state).items()}
    del hf_state["model.layers.1.mlp.experts.5.up_proj.weight"]
    (tmp_path / "hf").mkdir()
    save_file(hf_state, str(tmp_path / "hf/model.safetensors"))
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    with pytest.raises(UserError, match="lacks 1 tensor, e.g. layers.1.moe.experts.w3"):
        hf.read_full(tmp_path / "hf", adapter, shapes, None)
    hf_state["model.layers.1.mlp.experts.5.up_proj.weight"] = torch.zeros(64, 32)  # (in, out): transposed
    save_file(hf_state, str(tmp_path / "hf/model.safetensors"))
    with pytest.raises(
        UserError, match=r"is \(64, 32\), but the model's layers.1.moe.experts.w3 is \(8, 64, 32\)"
    ):
        hf.read_full(tmp_path / "hf", adapter, shapes, None)


def test_export_refuses_routing_qwen3_moe_cannot_express(tmp_path):
    from checkpoint import hf

    args = model_args(SPEC, "debugmodel_deepseek", 32, 258)
    with pytest.raises(
        UserError, match="it has no score_func, route_scale, n_expert_groups, shared_hidden_dim"
    ):
        hf.save({}, SPEC.state_dict_adapter(args), tmp_path / "hf", torch.float32, hf_assets_path="")
    assert not (tmp_path / "hf").exists()
