"""The training loop end to end: lr schedule, skipped updates, gradient accumulation, metrics,
torchrun, profiling the script."""

import math
import pstats
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, read_metrics, run_train

from configs import load_config
from configs.schema import ActivationCheckpoint, Float8, LRScheduler
from configs.schema import Optimizer as OptimizerConfig
from models import get_model_spec
from models.spec import model_args
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.float8 import apply_float8
from training import bf16_weights
from training import optimizer as optimizer_module
from training.grad_clip import clip_divisor, global_grad_norm
from training.metrics import lookup_peak_tflops
from training.optimizer import Optimizers, lr_factor
from training.weight_init import init_weights, materialize

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "source_samples",
               "source_epochs", "data_wait_ms"}  # fmt: skip


def schedule(*argv):
    return load_config(list(argv)).lr_scheduler


def test_warmup_then_linear_decay():
    config = schedule("--lr_scheduler.warmup_steps", "4", "--lr_scheduler.decay_type", "linear")
    factors = [lr_factor(i, 12, config) for i in range(12)]
    assert factors[:4] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert factors[4] == 1.0  # decay starts at the peak
    assert factors[4:] == pytest.approx([1 - j / 8 for j in range(8)])


def test_wsd_cosine_sqrt_and_min_lr():
    wsd = schedule("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.25",
                   "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.min_lr_factor", "0.1")  # fmt: skip
    factors = [lr_factor(i, 10, wsd) for i in range(10)]
    assert factors[2:8] == [1.0] * 6  # stable phase: 8 steps after warmup, the last 2 decay
    assert factors[8] == 1.0 and factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(10, 10, wsd) == pytest.approx(0.1)  # one past the end: the minimum
    sqrt = schedule("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_type", "sqrt")
    assert lr_factor(1, 5, sqrt) == pytest.approx(1 - math.sqrt(1 / 5))


def test_peak_lookup_prefers_the_more_specific_name():
    assert lookup_peak_tflops("NVIDIA H100 PCIe") < lookup_peak_tflops("NVIDIA H100 80GB HBM3")
    assert lookup_peak_tflops("NVIDIA GB200") != lookup_peak_tflops("NVIDIA B200")
    assert lookup_peak_tflops("Tesla T4") is None


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_skipped_update_leaves_weights_and_moments_untouched(implementation):
    """The non-finite guard's flag: fused AdamW reads it on the device, the others on the host."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    config = OptimizerConfig(implementation=implementation)
    optimizers = Optimizers([model], config, LRScheduler(warmup_steps=0), 10, torch.device("cpu"))
    snapshots = []
    for skip in (0.0, 1.0, 0.0):
        model(torch.randn(2, 4)).square().sum().backward()
        optimizers.step(skip=torch.tensor(skip))
        optimizers.zero_grad()
        state = optimizers.parts[0].state[model.weight]
        snapshots.append([model.weight.clone(), state["exp_avg"].clone(), float(state["step"])])
    assert torch.equal(snapshots[1][0], snapshots[0][0]) and torch.equal(snapshots[1][1], snapshots[0][1])
    assert snapshots[1][2] == 1 and snapshots[2][2] == 2
    assert not torch.equal(snapshots[2][0], snapshots[1][0])


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_clipping_by_the_update_equals_clipped_gradients(implementation):
    """Clipping is applied by Optimizers.step (fused AdamW divides inside its kernel, through its
    grad_scale): the same weights as torch's clip_grad_norm_ followed by an unclipped step."""
    config = OptimizerConfig(implementation=implementation, lr=0.1)
    runs = []
    for fused_clip in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        optimizers = Optimizers([model], config, LRScheduler(warmup_steps=0), 10, torch.device("cpu"))
        norms = []
        for _ in range(3):
            (10 * model(torch.randn(2, 4))).square().sum().backward()
            parameters = list(model.parameters())
            if fused_clip:
                norm = global_grad_norm(parameters)
                optimizers.step(skip=torch.tensor(0.0), clip=clip_divisor(norm, max_norm=0.5))
            else:
                norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm=0.5)
                optimizers.step(skip=torch.tensor(0.0))
            norms.append(float(norm))
            optimizers.zero_grad()
        runs.append((norms, [p.detach().clone() for p in model.parameters()]))
    (norms, weights), (reference_norms, reference_weights) = runs
    assert min(reference_norms) > 0.5  # clipping scaled every step
    assert norms == pytest.approx(reference_norms, rel=1e-6)
    for ours, theirs in zip(weights, reference_weights):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_bf16_weight_copies_train_as_autocast(checkpointing):
    """Linear layers on bf16 copies of their weights (training/bf16_weights.py), refreshed after
    each Optimizers.step, against autocast, with fused AdamW: the same losses and gradient norms,
    skipped steps change nothing, the state dicts keep their form, and refresh() follows weights
    loaded from outside. (The gradient norm sums the bf16 gradients in another order: last-bit
    differences in the clipping, so the weights and later losses are compared within tolerances.)"""
    spec = get_model_spec("llama3")
    args = model_args(spec, "tiny", 16, 258, ["tie_embeddings=true"])
    config, schedule = OptimizerConfig(implementation="fused", lr=3e-3), LRScheduler(warmup_steps=0)
    batches = [torch.randint(0, 258, (2, 17), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    runs = []
    for copied in (False, True):
        with torch.device("meta"):
            model, template = spec.model_cls(args), spec.model_cls(args)
        materialize(model, "cpu")
        init_weights(model, template, seed=0)
        model.init_buffers()
        apply_activation_checkpointing(
            model, ActivationCheckpoint(mode=checkpointing)
        )  # recomputes on the copies
        keys = {k: v.dtype for k, v in model.state_dict().items()}
        converted = bf16_weights.convert(model) if copied else 0
        optimizers = Optimizers([model], config, schedule, 10, torch.device("cpu"))
        losses, norms = [], []
        for index, batch in enumerate(batches):
            with torch.autocast("cpu", torch.bfloat16):
                logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            norm = global_grad_norm(bf16_weights.gradient_holders([model]))
            before = [p.detach().clone() for p in model.parameters()]
            optimizers.step(skip=torch.tensor(float(index == 2)), clip=clip_divisor(norm, max_norm=1.0))
            optimizers.zero_grad()
            if index == 2:  # a skipped step: no weight moved (and so no copy)
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            losses.append(loss.item())
            norms.append(norm.item())
        assert {k: v.dtype for k, v in model.state_dict().items()} == keys  # float32, same names
        copies = bf16_weights.copies(model)
        for weight, copy in copies.items():  # every copy is its weight rounded to bf16
            assert torch.equal(copy, weight.detach().to(torch.bfloat16))
        state = optimizers.parts[0].state_dict()["state"]
        runs.append((losses, norms, state, converted, model))
    (losses, norms, state, _, plain), (losses_c, norms_c, state_c, converted, model) = runs
    assert converted == 4 * args.n_layers + 3 * args.n_layers  # every block's matrices; not the tied output
    assert max(norms) > 1.0  # clipping scaled
    # Step 1: the same forward and backward; the norm of the bf16 gradients summed in float32.
    assert losses_c[0] == losses[0] and norms_c[0] == pytest.approx(norms[0], rel=1e-6)
    assert losses_c == pytest.approx(losses, rel=1e-5) and norms_c == pytest.approx(norms, rel=1e-5)
    for ours, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert all(s["step"] == 3 for s in state_c.values()) and state_c.keys() == state.keys()
    assert {k: set(v) for k, v in state_c.items()} == {k: set(v) for k, v in state.items()}
    with torch.no_grad():
        for weight in model.parameters():
            weight.fill_(0.5)
    bf16_weights.refresh([model])
    assert all(bool((copy == 0.5).all()) for copy in bf16_weights.copies(model).values())


@pytest.mark.parametrize("copied", [False, True])
def test_a_swapped_in_optimizer_performs_the_update(copied, monkeypatch):
    """One optimizer path: a forker's optimizer (here torch's SGD, swapped in where build_optimizer
    makes the optimizer) performs every update, with bf16 copies (whose gradients are moved onto
    the float32 weights, and which are refreshed from them) or without; clipping and skipping too."""
    monkeypatch.setattr(
        optimizer_module,
        "build_optimizer",
        lambda part, config, device: torch.optim.SGD(part.parameters(), lr=0.1),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, bias=False)
    if copied:
        assert bf16_weights.convert(model) == 1
    optimizers = Optimizers([model], OptimizerConfig(), LRScheduler(warmup_steps=0), 10, torch.device("cpu"))
    for skip in (0.0, 1.0):
        grad = torch.randn(32, 64).to(torch.bfloat16)
        (holder,) = bf16_weights.gradient_holders([model])
        holder.grad = grad.clone() if copied else grad.float()
        before = model.weight.detach().clone()
        optimizers.step(skip=torch.tensor(skip), clip=torch.tensor(2.0))
        expected = before if skip else before - 0.1 * grad.float() / 2.0
        torch.testing.assert_close(model.weight.detach(), expected, rtol=0, atol=1e-7)
        if copied:
            assert torch.equal(model.bf16_weight, model.weight.detach().to(torch.bfloat16))
        optimizers.zero_grad()
        assert model.weight.grad is None and (not copied or model.bf16_weight.grad is None)


def test_float8_layers_compute_on_bf16_copies():
    """torchao's Float8Linear (emulated on the CPU) on a bf16 copy: the output and the copy's bf16
    gradient equal those of a Float8Linear whose weight is that copy (as under FSDP's bf16
    parameters); the float32 weight gets no gradient until the step; the step refreshes the copy."""
    copied, reference = [
        torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 32, bias=False))
        for _ in range(2)
    ]
    reference.load_state_dict(copied.state_dict())
    for model in (copied, reference):  # as train.py converts them (tensorwise, emulated on the CPU)
        apply_float8(model, Float8(enable=True), torch.device("cpu"))
    for layer in reference:
        layer.weight = torch.nn.Parameter(layer.weight.detach().to(torch.bfloat16))
    assert bf16_weights.convert(copied) == 2
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    outputs = [model(x) for model in (copied, reference)]
    for output in outputs:
        output.float().square().sum().backward()
    assert torch.equal(*outputs)
    for ours, theirs in zip(copied, reference):
        assert ours.weight.grad is None and ours.bf16_weight.grad.dtype == torch.bfloat16
        assert torch.equal(ours.bf16_weight.grad, theirs.weight.grad)
    config = OptimizerConfig(implementation="fused")
    optimizers = Optimizers([copied], config, LRScheduler(), 10, torch.device("cpu"))
    before = copied[0].bf16_weight.clone()
    optimizers.step()
    assert not torch.equal(copied[0].bf16_weight, before)
    for weight, bf16_copy in bf16_weights.copies(copied).items():
        assert torch.equal(bf16_copy, weight.detach().to(torch.bfloat16))


@pytest.mark.slow
def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    runs = {}
    for local in (4, 1):  # accumulation 1 and 4
        folder = tmp_path / f"local{local}"
        run_train([*TINY, "--training.local_batch_size", str(local), "--training.global_batch_size", "4",
                   "--job.dump_folder", str(folder)])  # fmt: skip
        runs[local] = read_metrics(folder)
    reference = runs[4]
    for a, b in zip(runs[1], reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert len(reference) == 6


def test_host_reads_are_the_values_as_float64():
    """training/host_reads.py (the CPU path; the GPU test checks the CUDA one and why it exists)."""
    from training.host_reads import read_float, to_host

    values = [torch.tensor(2.5), torch.arange(6).view(2, 3), torch.tensor(True)]
    for read, expected in zip(to_host(*values), values):
        assert read.dtype == torch.float64 and torch.equal(read, expected.double())
    assert read_float(torch.tensor(-1.25)) == -1.25


def test_metrics_records(tmp_path):
    run_train([*TINY, "--job.dump_folder", str(tmp_path), "--metrics.log_freq", "4",
               "--metrics.enable_tensorboard", "true"])  # fmt: skip
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [4, 6]  # every log_freq steps and the last
    args = model_args(get_model_spec("llama3"), "tiny", 32, 258)
    with torch.device("meta"):
        flops_per_token = get_model_spec("llama3").model_cls(args).flops_per_token(32)
    for record in records:
        assert set(record) == METRIC_KEYS
        assert record["tps"] > 0 and record["memory_gib"] > 0 and record["mfu"] is None  # no peak on CPU
        assert record["tflops"] == pytest.approx(record["tps"] * flops_per_token / 1e12, rel=1e-2, abs=1e-3)
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
        assert record["source_samples"] == {"python_docs": record["step"] * 4} and record["data_wait_ms"] >= 0
    config = load_config(TINY)
    assert records[0]["lr"] == pytest.approx(config.optimizer.lr * lr_factor(3, 6, config.lr_scheduler))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_torchrun_single_process_equals_plain_python(tmp_path):
    args = [*TINY, "--training.steps", "8", "--optimizer.lr", "1e-2"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "python")])
    run_train([*args, "--job.dump_folder", str(tmp_path / "torchrun")], nproc=1, torchrun=True)
    plain, launched = read_metrics(tmp_path / "python"), read_metrics(tmp_path / "torchrun")
    assert [r["loss"] for r in plain] == [r["loss"] for r in launched]
    assert launched[-1]["loss"] < launched[0]["loss"] - 0.3  # it learns


@pytest.mark.slow
def test_train_py_runs_under_cprofile_and_atexit(tmp_path):
    """train.py returns through sys.exit (no os._exit): atexit handlers run, and cProfile, which
    writes its file after the script returns, works."""
    profile, marker = tmp_path / "train.prof", tmp_path / "atexit.txt"
    wrapper = (f"import atexit, pathlib; atexit.register(pathlib.Path({str(marker)!r}).write_text, 'ran'); "
               f"import cProfile, sys; sys.argv = ['cProfile', '-o', {str(profile)!r}, *sys.argv[1:]]; "
               "cProfile.main()")  # fmt: skip
    args = [*TINY, "--training.steps", "2", "--job.dump_folder", str(tmp_path / "run")]
    result = subprocess.run([sys.executable, "-c", wrapper, str(REPO / "train.py"), *args], cwd=REPO,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert marker.read_text() == "ran"
    stats = pstats.Stats(str(profile))
    assert any(function == "train" for (_, _, function) in stats.stats)
