"""torch.compile, activation checkpointing and float8: same training, on every layout they support.

fp32 on CPU, so each must reproduce the plain single-process run (compile within 1e-5: its fused
kernels round differently; checkpointing exactly: it recomputes the same ops).

Compiled runs on several ranks check what the layouts add to compiling (graphs around FSDP's and
EP's hooks, DTensors, checkpoint wrappers, pipeline stages, CP between graphs; nothing recompiled)
with `compile.backend = "aot_eager"`: the same dynamo and AOT-autograd graphs as inductor's, run
with eager kernels (inductor's C++ compile of each rank's graphs costs 30 s per run here).
Inductor itself runs in one process (op-ac) here, and on several GPUs in tests/test_gpu.py.
"""

import os

import pytest
from conftest import SHORT_DOCUMENTS, TINY, read_metrics, run_train

from parallelisms.compile import COMPILED_CHECKPOINT_FAILS_WITH_TP

STEPS = 6
COMMON = [*TINY, "--training.steps", str(STEPS), "--training.global_batch_size", "8"]
SINGLE = ["--training.local_batch_size", "8"]
COMPILE = ["--compile.enable"]
TRACED = [*COMPILE, "--compile.backend", "aot_eager"]  # see the module's docstring
DOCUMENTS = ["--model.attention_mask", "document", "--training.dataset", "text",
             "--training.dataset_path", SHORT_DOCUMENTS]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """One compile cache for the module's runs: a cold inductor compile costs ~15 s per process."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


@pytest.fixture(scope="module")
def eager_runs(single_process_runs):
    """Plain single-process runs, one per model and data/masking (`DOCUMENTS`), made on first use
    (tests/test_parallel.py's references, built alike, are the same runs)."""

    def eager(model: str = "llama3", documents: bool = False) -> list[dict]:
        extra = DOCUMENTS if documents else []
        return single_process_runs([*COMMON, "--model.name", model, *extra, *SINGLE])

    return eager


@pytest.fixture(scope="module")
def eager(eager_runs) -> list[dict]:
    return eager_runs("llama3")


def assert_same_losses(records: list[dict], reference: list[dict], rel: float) -> None:
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=rel, abs=0), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=max(rel, 1e-6) * 10), got["step"]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2_CP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, overrides",
    [
        # with loss parallel; every 2nd block checkpointed: compiled blocks with and without a
        # checkpoint wrapper around them (parallelisms/compile.py, compile_inside_checkpointing);
        # document masking: the mask is an input of every compiled block
        (2, [*SINGLE, *TP2, "--activation_checkpoint.mode", "selective",
             "--activation_checkpoint.selective_ac_option", "2", *DOCUMENTS]),
        # CP attention runs eagerly between graphs
        (4, [*SINGLE, *PP2_CP2, "--activation_checkpoint.mode", "full"]),
        # one process: checkpointing by op (not with CP or EP: parallelisms/activation_checkpoint.py)
        (None, [*SINGLE, "--activation_checkpoint.mode", "selective"]),  # selective_ac_option "op"
        # by op with TP: the compiled checkpoint, which torch < 2.14 fails (refused there)
        pytest.param(2, [*SINGLE, *TP2, "--activation_checkpoint.mode", "selective"],
                     marks=pytest.mark.skipif(COMPILED_CHECKPOINT_FAILS_WITH_TP, reason="torch < 2.14")),
    ],
    ids=["tp2-ac-document", "pp2-cp2-ac", "op-ac", "tp2-op-ac"],
)  # fmt: skip
def test_compile_matches_eager_without_recompiles(nproc, overrides, eager_runs, tmp_path):
    compiled = COMPILE if nproc is None else TRACED
    result = run_train([*COMMON, *compiled, *overrides, "--job.dump_folder", str(tmp_path)], nproc=nproc)
    assert_same_losses(read_metrics(tmp_path), eager_runs(documents="document" in overrides), rel=1e-5)
    assert "torch.compile: 0 graphs compiled after step 2" in result.stdout


def test_recompile_watch_counts_fullgraph_recompilations():
    """A block compiled whole (fullgraph, as apply_compile compiles blocks) that compiles again
    after warm-up is counted: dynamo's frame counters, which the watch read before, leave
    fullgraph compilations out, so "0 frames compiled after step 2" held whatever compiled."""
    import torch

    from parallelisms.compile import RecompileWatch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).relu()

    block, watch = Block(), RecompileWatch(enabled=True)
    block.compile(fullgraph=True, backend="eager")
    for dtype in (torch.float32, torch.float32, torch.float32, torch.float64):  # the last recompiles
        with watch.watch("train", warm_up_calls=2):
            block.to(dtype)(torch.randn(2, 4, dtype=dtype))
    assert watch.calls["train"] == 4 and watch.recompiled == 1


def test_compile_backend_reaches_every_block_and_the_loss():
    """compile.backend = "aot_eager" traces every block and the loss through dynamo and AOT autograd
    and never calls inductor (the multi-rank compiled runs above depend on it); the loss equals
    the eager model's."""
    import torch
    from test_model import build

    from parallelisms.compile import apply_compile
    from training.loss import TokenNormalizedLoss

    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = TokenNormalizedLoss(32)(build()(tokens), tokens)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = build()
    apply_compile(model, fullgraph=True, backend="aot_eager")
    loss = TokenNormalizedLoss(32, compile_backend="aot_eager")(model(tokens), tokens)
    loss.backward()
    assert counters["stats"]["unique_graphs"] >= 2 and counters["aot_autograd"]["total"] >= 2
    assert not counters["inductor"], dict(counters["inductor"])
    assert loss.item() == pytest.approx(eager.item(), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", [["full"], ["selective", "--activation_checkpoint.selective_ac_option", "op"],
             ["selective", "--activation_checkpoint.selective_ac_option", "2"]],
    ids=["full", "selective-op", "every-2nd-block"],
)  # fmt: skip
def test_activation_checkpointing_is_exact(mode, eager, tmp_path):
    run_train([*COMMON, *SINGLE, "--activation_checkpoint.mode", *mode, "--job.dump_folder", str(tmp_path)])
    assert_same_losses(read_metrics(tmp_path), eager, rel=0)


def test_checkpointed_and_compiled_blocks_save_under_the_plain_names():
    """Activation checkpointing's and torch.compile's wrappers leave no trace in what a checkpoint
    calls the model's and AdamW's tensors, so a run with either resumes on any layout without them
    (checkpoints of the plain model resume across layouts: tests/test_checkpoint.py)."""
    import torch
    from test_model import build

    from checkpoint.state import model_state, optimizer_state
    from configs.schema import ActivationCheckpoint
    from parallelisms.activation_checkpoint import apply_activation_checkpointing
    from parallelisms.compile import apply_compile

    names = []
    for wrap in (False, True):
        model = build()
        if wrap:  # every 2nd block: wrapped and plain blocks side by side, all compiled
            every_second = ActivationCheckpoint(mode="selective", selective_ac_option="2")
            apply_activation_checkpointing(model, every_second)
            apply_compile(model, fullgraph=True)
            assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
        optimizer = torch.optim.AdamW(model.parameters())
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()  # (AdamW's moments exist)
        names.append((sorted(model_state([model])), sorted(optimizer_state([model], [optimizer]))))
    assert names[0] == names[1] and any("exp_avg" in name for name in names[0][1])


@pytest.mark.slow
def test_float8_tracks_full_precision_over_100_steps(tmp_path):
    """torchao float8 (emulated on CPU) against float32 on the same data: the loss over the last 50
    of 100 steps (one step's loss is too noisy at this size) within 1% (measured: 0.11%; the 300-step
    Llama 3 1B comparison on the H200: docs/performance.md)."""
    args = [*TINY, "--training.steps", "100", "--training.local_batch_size", "8",
            "--lr_scheduler.warmup_steps", "20", "--optimizer.lr", "3e-3"]  # fmt: skip
    run_train([*args, "--job.dump_folder", str(tmp_path / "fp32")])
    run_train([*args, "--float8.enable", "--job.dump_folder", str(tmp_path / "fp8")])
    full, fp8 = ([r["loss"] for r in read_metrics(tmp_path / name)] for name in ("fp32", "fp8"))
    assert sum(full[-50:]) / 50 < sum(full[:10]) / 10 - 2.0  # it learned
    assert sum(fp8[-50:]) / 50 == pytest.approx(sum(full[-50:]) / 50, rel=0.01)


@pytest.mark.slow
def test_float8_with_tensor_parallelism_and_fsdp_float8_all_gather(tmp_path, model="llama3"):
    """float8 under FSDP 2 x TP 2 with FSDP's float8 all-gather and precomputed scales tracks the
    single process's float8 run (TP shards the weights; the scales are the whole tensors'). Trained
    by Muon: its update reaches torchao's float8 weight wrappers inside FSDP's strided shards."""
    single, sharded = tmp_path / "single", tmp_path / "fsdp2_tp2"
    float8 = ["--float8.enable", "--float8.enable_fsdp_float8_all_gather",
              "--float8.precompute_float8_dynamic_scale_for_fsdp"]  # fmt: skip
    common = [*COMMON, "--model.name", model, *MUON]
    run_train([*common, *SINGLE, "--float8.enable", "--job.dump_folder", str(single)])
    layout = ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]
    run_train([*common, *layout, *float8, "--job.dump_folder", str(sharded)], nproc=4)
    # float8 rounds the sharded run's last-bit differences to different float8 values, which Muon's
    # steps of about lr carry: up to 6e-4 apart over 10 steps (without float8 1e-7, test_parallel.py).
    assert_same_losses(read_metrics(sharded), read_metrics(single), rel=1e-3)
    assert read_metrics(single)[-1]["loss"] < read_metrics(single)[0]["loss"] - 1


# tests/test_parallel.py's Muon layouts: the same arguments in the same order, so the same
# single-process reference.
MUON = ["--optimizer.name", "Muon", "--optimizer.lr", "0.02", "--training.steps", "10"]


@pytest.mark.slow
def test_muon_compiled_matches_eager(single_process_runs, tmp_path):
    """Muon under FSDP 2 with compiled blocks: the eager single-process losses, nothing recompiled."""
    result = run_train([*COMMON, *MUON, *TRACED, "--training.local_batch_size", "4", "--job.dump_folder",
                        str(tmp_path)], nproc=2)  # fmt: skip
    reference = single_process_runs([*COMMON, "--model.name", "llama3", *MUON, *SINGLE])
    assert_same_losses(read_metrics(tmp_path), reference, rel=1e-5)
    assert "torch.compile: 0 graphs compiled after step 2" in result.stdout


EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, overrides",
    [
        # EP 2 (all-to-all hooks around the experts: blocks are not one graph) with checkpointing
        # (dynamo traces the experts' DTensor weights differently inside a checkpoint), on
        # DeepSeek-V3: MLA's blocks and the MTP block. (EP 2 compiled without checkpointing:
        # tests/test_gpu.py's moe_ep2_compile.)
        ("deepseek_v3", [*EP2, "--activation_checkpoint.mode", "full"]),
        # PP 2: whole-block graphs (fullgraph), with the first step's shape-inference bookkeeping
        # around the stages (parallelisms/pipeline.py) outside them
        ("qwen3_moe", ["--parallelism.pipeline_parallel_degree", "2", *SINGLE]),
    ],
    ids=["deepseek-ep2-ac", "pp2"],
)
def test_moe_compiled_matches_eager(model, overrides, eager_runs, tmp_path):
    """An MoE model compiled on two ranks: the eager single-process losses, nothing recompiled."""
    moe = ["--model.name", model, *TRACED, *overrides]
    result = run_train([*COMMON, *moe, "--job.dump_folder", str(tmp_path)], nproc=2)
    assert_same_losses(read_metrics(tmp_path), eager_runs(model), rel=1e-5)
    assert "torch.compile: 0 graphs compiled after step 2" in result.stdout
