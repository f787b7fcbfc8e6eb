"""Muon (training/muon.py) and the AdamW with bf16 moments (training/adamw.py) in one process:
torch's arithmetic, which parameters get which, the start-up line. The distributed layouts are
in tests/test_parallel.py (MUON_LAYOUTS), checkpoints in tests/test_checkpoint.py."""

import copy
import re
import sys

import pytest
import torch
from conftest import REPO, run_ranks

from configs.schema import LRScheduler
from configs.schema import Optimizer as OptimizerConfig
from models import get_model_spec
from models.spec import model_args
from training.adamw import AdamW
from training.muon import Muon, newton_schulz
from training.optimizer import Optimizers, describe_roles, parameter_roles
from training.weight_init import init_weights, materialize

QUINTIC = (3.4445, -4.7750, 2.0315)


def muon_group(params, adjust="match_rms_adamw", in_out=False, **settings):
    group = dict(params=params, algorithm="muon", lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1,
                 adjust_lr=adjust, matrices_in_out=in_out)  # fmt: skip
    return group | settings


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(32, 64), (48, 16)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_torch_muon(adjust, shape, nesterov):
    """A 2-D matrix's update, Newton-Schulz in bf16: torch.optim.Muon's (torch 2.13), to the bit
    here (the same operations), within bf16 tolerance in the issue's terms."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is in torch >= 2.9")
    torch.manual_seed(0)
    start = torch.randn(*shape)
    ours_w, torch_w = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = Muon([muon_group([ours_w], adjust, nesterov=nesterov)], 5, QUINTIC, torch.bfloat16, torch.float32)
    reference = torch.optim.Muon([torch_w], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                                 adjust_lr_fn=adjust)  # fmt: skip
    for _ in range(3):
        grad = torch.randn(*shape)
        ours_w.grad, torch_w.grad = grad.clone(), grad.clone()
        ours.step()
        reference.step()
        torch.testing.assert_close(ours_w, torch_w, rtol=1e-2, atol=1e-3)
    assert not torch.equal(ours_w, start)
    torch.testing.assert_close(
        ours.state[ours_w]["momentum_buffer"], reference.state[torch_w]["momentum_buffer"], rtol=0, atol=0
    )


def test_stacked_experts_are_orthogonalized_expert_by_expert():
    """A stack of experts stored (experts, in, out): each expert's update is that of its (out, in)
    matrix on its own, the lr adjustment reading out as rows."""
    torch.manual_seed(0)
    stacked = torch.nn.Parameter(torch.randn(4, 16, 48))  # (experts, in, out)
    singles = [torch.nn.Parameter(stacked[e].detach().T.clone()) for e in range(4)]  # (out, in)
    ours = Muon([muon_group([stacked], "original", in_out=True)], 5, QUINTIC, torch.float32, torch.float32)
    reference = Muon([muon_group(singles, "original")], 5, QUINTIC, torch.float32, torch.float32)
    for _ in range(2):
        grad = torch.randn(4, 16, 48)
        stacked.grad = grad.clone()
        for e, single in enumerate(singles):
            single.grad = grad[e].T.clone()
        ours.step()
        reference.step()
    for e, single in enumerate(singles):
        torch.testing.assert_close(stacked[e].T, single, rtol=1e-6, atol=1e-6)


def test_newton_schulz_orthogonalizes():
    """Five quintic steps bring every singular value near 1 (the iteration's ~0.7-1.2 band), in
    both orientations and batched."""
    torch.manual_seed(0)
    for shape in [(64, 256), (256, 64), (3, 32, 96)]:
        result = newton_schulz(torch.randn(*shape), 5, QUINTIC, torch.float32)
        singular = torch.linalg.svdvals(result)
        assert result.shape == shape and singular.min() > 0.6 and singular.max() < 1.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_moments_in_bf16_follow_torch_arithmetic(dtype):
    """training/adamw.py: with float32 moments, torch's foreach AdamW to the bit; with bf16 moments,
    torch's AdamW run on the moments rounded to bf16 after every step."""
    torch.manual_seed(0)
    start = [torch.randn(32, 16), torch.randn(16)]
    ours_p = [torch.nn.Parameter(t.clone()) for t in start]
    torch_p = [torch.nn.Parameter(t.clone()) for t in start]
    groups = lambda params: [
        {"params": params[:1], "weight_decay": 0.1},
        {"params": params[1:], "weight_decay": 0.0},
    ]
    ours = AdamW(groups(ours_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, state_dtype=dtype)
    reference = torch.optim.AdamW(groups(torch_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for _ in range(5):
        for a, b in zip(ours_p, torch_p):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours.step()
        reference.step()
        for p in torch_p:  # the reference's moments, rounded as ours are stored
            for key in ("exp_avg", "exp_avg_sq"):
                reference.state[p][key].copy_(reference.state[p][key].to(dtype))
        for a, b in zip(ours_p, torch_p):
            assert torch.equal(a, b)
            for key in ("exp_avg", "exp_avg_sq"):
                assert ours.state[a][key].dtype == dtype
                assert torch.equal(ours.state[a][key].float(), reference.state[b][key])
            assert ours.state[a]["step"] == reference.state[b]["step"]


def test_roles_and_the_start_up_line():
    """Muon: the blocks' matrices and stacked experts; AdamW: embeddings, output, norms, router
    gates; patterns move parameters either way."""
    spec = get_model_spec("qwen3_moe")
    with torch.device("meta"):
        model = spec.model_cls(model_args(spec, "tiny", 16, 258, []))
    roles = parameter_roles(model, OptimizerConfig(name="Muon"))
    muon = {n for n, r in roles.items() if r == "muon"}
    assert "layers.0.attention.wq.weight" in muon and "layers.1.moe.experts.w2" in muon
    assert not muon & {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.moe.router.weight",
                       "layers.0.attention.q_norm.weight"}  # fmt: skip
    moved = parameter_roles(model, OptimizerConfig(name="Muon", muon_params=["output.weight"],
                                                   adamw_params=["*.router.*", "*.wo.weight"]))  # fmt: skip
    assert moved["output.weight"] == "muon" and moved["layers.0.attention.wo.weight"] == "adamw"
    assert set(parameter_roles(model, OptimizerConfig()).values()) == {"adamw"}
    line = describe_roles(roles)
    assert line.startswith("Muon: layers.*.attention.wq.weight,") and "AdamW: tok_embeddings.weight" in line
    assert "layers.0." not in line


def test_biases_of_any_shape_take_adamw():
    """gpt-oss's biases, the experts' stacked ones (experts x out, 2-D) included, go to AdamW by the
    rule itself, with no adamw_params pattern, and even when muon_params names them; its weights
    beside them (stacked experts, projections) still go to Muon."""
    spec = get_model_spec("gpt_oss")
    with torch.device("meta"):
        model = spec.model_cls(model_args(spec, "tiny", 16, 258, []))
    assert model.layers["0"].moe.experts.gate_up_bias.ndim == 2
    for config in (OptimizerConfig(name="Muon", adamw_params=[]),
                   OptimizerConfig(name="Muon", muon_params=["*bias"])):  # fmt: skip
        roles = parameter_roles(model, config)
        biases = {name: role for name, role in roles.items() if name.endswith("bias")}
        assert {"layers.0.moe.experts.gate_up_bias", "layers.1.moe.experts.down_bias",
                "layers.0.attention.wq.bias", "layers.0.moe.router.bias"} <= set(biases)  # fmt: skip
        assert set(biases.values()) == {"adamw"}
        assert roles["layers.0.moe.experts.gate_up"] == roles["layers.0.attention.wq.weight"] == "muon"


def test_muon_optimizers_train_and_schedule_both_groups():
    """Optimizers with optimizer.name = "Muon" on a MoE model: both algorithms' groups follow the
    schedule (muon_lr and lr), clipping divides the gradients first, a skipped step changes nothing,
    and the bf16 state option halves the state."""
    spec = get_model_spec("qwen3_moe")
    args = model_args(spec, "tiny", 16, 258, [])
    with torch.device("meta"):
        model, template = spec.model_cls(args), spec.model_cls(args)
    materialize(model, "cpu")
    init_weights(model, template, seed=0)
    model.init_buffers()
    config = OptimizerConfig(name="Muon", lr=1e-3, muon_lr=2e-2, state_dtype="bfloat16")
    optimizers = Optimizers([model], config, LRScheduler(warmup_steps=1), 10, torch.device("cpu"))
    (optimizer,) = optimizers.parts
    assert isinstance(optimizer, Muon)
    assert optimizers.set_lr(1) == pytest.approx(0.5e-3)
    assert sorted({g["lr"] for g in optimizer.param_groups}) == pytest.approx([0.5e-3, 1e-2])
    tokens = torch.randint(0, 258, (2, 16))
    for skip in (0.0, 1.0):
        model(tokens).float().square().mean().backward()
        before = copy.deepcopy(model.state_dict())
        optimizers.step(skip=torch.tensor(skip), clip=torch.tensor(3.0))
        optimizers.zero_grad()
        moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        assert bool(moved) == (not skip)
    states = optimizer.state.values()
    assert {s["momentum_buffer"].dtype for s in states if "momentum_buffer" in s} == {torch.bfloat16}
    assert {s["exp_avg"].dtype for s in states if "exp_avg" in s} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [["--parallelism.tensor_parallel_degree", "2"],
     ["--model.name", "qwen3_moe", "--parallelism.expert_parallel_degree", "2"]],
    ids=["fsdp2_tp2", "ep2_fsdp2"],
)  # fmt: skip
def test_each_matrix_is_orthogonalized_once_and_the_work_divides(overrides):
    """4 ranks (tests/muon_probe.py): the matrices each rank orthogonalizes add up to the model's
    Muon matrices (each expert one), and shares differ by at most one matrix per stack."""
    result = run_ranks([sys.executable, str(REPO / "tests/muon_probe.py"), *overrides], 4, timeout=300)
    shares = [int(n) for n in re.findall(r"rank \d orthogonalized (\d+)", result.stdout)]
    calls = max(int(n) for n in re.findall(r"in (\d+) calls", result.stdout))
    (total,) = [int(n) for n in re.findall(r"muon matrices (\d+)", result.stdout)]
    assert len(shares) == 4 and sum(shares) == total > 0
    assert max(shares) - min(shares) <= calls


def test_resumed_optimizer_keeps_this_runs_settings(tmp_path, caplog):
    """The state loads (momentum buffers, moments) but the settings stay the config's: a resumed
    run follows its config, for Muon's settings as for AdamW's, and says which changed."""
    import logging

    import torch.distributed.checkpoint as dcp

    from checkpoint.state import load_optimizer_state, optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    muon = dict(name="Muon", muon_params=["0.weight"])  # (not in a block)
    before = OptimizerConfig(**muon, beta2=0.95, muon_momentum=0.9, muon_adjust_lr="original")
    after = OptimizerConfig(**muon, beta2=0.99, muon_momentum=0.8, muon_adjust_lr="none", muon_weight_decay=0)
    saved = Optimizers([model], before, LRScheduler(), 10, torch.device("cpu"))
    model(torch.randn(4, 8)).square().sum().backward()
    saved.step()
    saved.zero_grad()
    dcp.save(optimizer_state([model], saved.parts), checkpoint_id=tmp_path)
    resumed = Optimizers([model], after, LRScheduler(), 10, torch.device("cpu"))
    state = optimizer_state([model], resumed.parts)
    dcp.load(state, checkpoint_id=tmp_path)
    with caplog.at_level(logging.INFO, logger="checkpoint.state"):
        load_optimizer_state([model], resumed.parts, state)
    said = caplog.text.split("optimizer settings from the config, not the checkpoint's: ")[1]
    assert "betas (0.9, 0.95) there, (0.9, 0.99) here" in said and "momentum 0.9 there, 0.8 here" in said
    assert "adjust_lr original there, none here" in said and " lr " not in said
    (ours,), (theirs,) = resumed.parts, saved.parts
    loaded = [
        (key, torch.equal(value, ours.state[p][key]))
        for p in theirs.state
        for key, value in theirs.state[p].items()
    ]
    assert {key for key, _ in loaded} == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert all(same for _, same in loaded)
    groups = {g["algorithm"]: g for g in ours.param_groups}
    assert groups["muon"]["momentum"] == 0.8 and groups["muon"]["adjust_lr"] == "none"
    assert groups["muon"]["weight_decay"] == 0 and groups["adamw"]["betas"] == (0.9, 0.99)


def test_memory_estimate_counts_the_optimizer_state():
    """The estimate (and so the dry run and the fit check) counts AdamW's two moments, Muon's one
    buffer, in the state dtype."""
    from training.memory_estimate import GIB, estimate

    spec = get_model_spec("qwen3_moe")
    args = model_args(spec, "tiny", 16, 258, [])
    with torch.device("meta"):
        model = spec.model_cls(args)
    numel = {name: p.numel() for name, p in model.named_parameters()}
    muon_numel = sum(
        n for name, n in numel.items() if parameter_roles(model, OptimizerConfig(name="Muon"))[name] == "muon"
    )
    total = sum(numel.values())
    expected = {
        ("AdamW", "float32"): 8 * total,
        ("AdamW", "bfloat16"): 4 * total,
        ("Muon", "float32"): 4 * muon_numel + 8 * (total - muon_numel),
        ("Muon", "bfloat16"): 2 * muon_numel + 4 * (total - muon_numel),
    }
    for (name, dtype), state_bytes in expected.items():
        config = OptimizerConfig(name=name, state_dtype=dtype)
        got = estimate([model], args, 64, 1, 0, "none", tail=spec.tail, optimizer=config)
        assert got.optimizer_gib * GIB == pytest.approx(state_bytes, rel=1e-9), (name, dtype)
    assert 0 < muon_numel < total


def measured_maxima(model, tokens) -> torch.Tensor:
    """Each attention layer's per-head largest logit in a forward of tokens (the hooks' record)."""
    kernels = [m.kernel for m in model.modules() if hasattr(m, "qk_clip_scales")]
    for kernel in kernels:
        kernel.max_logits.fill_(float("-inf"))
    with torch.no_grad():
        model(tokens)
    return torch.stack([kernel.max_logits.clone() for kernel in kernels])


@pytest.mark.parametrize("name", ["llama3", "qwen3", "deepseek_v3"])
def test_qk_clip_brings_the_largest_logits_to_the_threshold(name):
    """MuonClip: the hook's maxima are the causal logits' (checked against the full logits matrix
    on one layer); after a clip the heads that exceeded the threshold peak at it on the same tokens
    (Llama 3, MLA: per head, the others untouched; Qwen3: every head by the shared norms' factor,
    the largest at the threshold; checked on the first layer, whose input the clip leaves alone),
    and a skipped step clips nothing."""
    from training.qk_clip import QKClip, max_logits

    torch.manual_seed(0)
    spec = get_model_spec(name)
    args = model_args(spec, "tiny", 16, 258, ["n_layers=2"] if name != "deepseek_v3" else [])
    with torch.device("meta"):
        model, template = spec.model_cls(args), spec.model_cls(args)
    materialize(model, "cpu")
    init_weights(model, template, seed=0)
    model.init_buffers()
    clip = QKClip([model], threshold=float("inf"), device=torch.device("cpu"))
    tokens = torch.randint(0, 258, (2, 16))
    before = measured_maxima(model, tokens)
    # The first layer (whose input a clip leaves as it was): some heads above, some below.
    clip.threshold = threshold = before[0].median().item()
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    full = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / 8**0.5
    causal = full.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(max_logits(q, k), causal.amax(dim=(0, 2, 3)))
    assert (before[0] > threshold).any() and (before[0] < threshold).any()
    measured_maxima(model, tokens)
    clip.after_step(skip=torch.tensor(1.0))
    torch.testing.assert_close(measured_maxima(model, tokens), before)  # skipped: nothing clipped
    clip.after_step()
    after = measured_maxima(model, tokens)[0]
    if name == "qwen3":  # every head by the factor of the largest
        torch.testing.assert_close(after, before[0] * threshold / before[0].max(), rtol=1e-5, atol=0)
    else:
        torch.testing.assert_close(after, before[0].clamp(max=threshold), rtol=1e-5, atol=0)


def probe_norms(model: str, threshold: str, nproc: int, overrides: list[str]) -> dict[str, dict[str, float]]:
    command = [sys.executable, str(REPO / "tests/qk_clip_probe.py"), "--model.name", model,
               "--optimizer.qk_clip_threshold", threshold, *overrides]  # fmt: skip
    result = run_ranks(command, nproc, timeout=300)
    norms = {"before": {}, "after": {}}
    for when, name, value in re.findall(r"^(before|after) (\S+) (\S+)$", result.stdout, re.MULTILINE):
        norms[when][name] = float(value)
    return norms


@pytest.mark.slow
@pytest.mark.parametrize("model, threshold", [("qwen3", "4"), ("deepseek_v3", "0.5")])
def test_qk_clip_under_fsdp_and_tp_equals_one_process(model, threshold):
    """MuonClip at FSDP 2 x TP 2 (tests/qk_clip_probe.py): the logit maxima gathered over TP's heads
    and reduced over the data-parallel ranks, the scales applied through FSDP's strided shards: the
    clipped query and key weights of one process (which did clip). Qwen3's attention is Llama 3's
    with QK-norm, under its own TP plan; Llama 3 clips in one process above."""
    one = probe_norms(model, threshold, 1, [])
    sharded = probe_norms(model, threshold, 4, ["--parallelism.tensor_parallel_degree", "2"])
    assert one["after"] and any(one["after"][n] < 0.99 * one["before"][n] for n in one["after"])
    assert sharded["after"] == pytest.approx(one["after"], rel=1e-6)
