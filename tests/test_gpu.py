"""The multi-GPU suite: every layout that fits the machine's GPUs against one GPU, on CUDA and NCCL.

    bash tests/gpu_tests.sh            # on a machine with 2 or more GPUs; results in gpu_results.jsonl

Each test is a real `torchrun ... train.py` launch of the debug model; the reference is the same
config on one GPU. On a machine with fewer GPUs than a test needs it is skipped, with the reason.
Bars (docs/validation.md says where they come from), relative, loss and grad norm:
  fp32   step 1 within 1e-6, every step within FP32_BAR (measured: at most 3e-7 over 20 steps on
         every layout, TP included once clipping scaled partial gradients right)
  bf16   every step's loss within BF16_BAR of the one-GPU bf16 run (measured: at most 9e-4)
Every result is also appended to $GPU_RESULTS (a JSON line per run: the largest relative difference
at step 1 and over all steps), from which docs/validation.md's table is written.
"""

import json
import os
import shutil

import pytest
import torch
from conftest import REPO, SHORT_DOCUMENTS, read_metrics, run_train
from test_context_parallel import check_chunk_attention

from models.attention import (
    causal_mask,
    document_ids,
    document_mask,
    masked_attention,
    sink_attention,
    within_window,
)
from parallelisms.context_parallel import local_positions

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
STEPS = 20
FP32_BAR = 1e-5
BF16_BAR = 5e-3
COMMON = [
    "--config", str(REPO / "configs" / "llama3_debug.toml"), "--model.flavor", "debugmodel",
    "--training.seq_len", "256", "--training.steps", str(STEPS),
    "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false", "--training.device", "cuda",
]  # fmt: skip
FP32 = ["--training.mixed_precision_param", "float32"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
TP2, PP2, CP2 = (
    f"--parallelism.{key}_parallel_degree 2".split() for key in ("tensor", "pipeline", "context")
)
SCHEDULE = "--parallelism.pipeline_parallel_schedule"


def gpus(n: int):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} CUDA GPUs, this machine has {GPUS}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One-GPU runs, one per precision and extra overrides, made on first use."""
    made = {}

    def reference(precision: list[str], extra: tuple[str, ...] = ()) -> list[dict]:
        key = (*precision, *extra)
        if key not in made:
            folder = tmp_path_factory.mktemp("single")
            run_train([*COMMON, *precision, *extra, "--training.local_batch_size", "8",
                       "--job.dump_folder", str(folder)], nproc=1, torchrun=True)  # fmt: skip
            made[key] = read_metrics(folder)
        return made[key]

    return reference


def differences(records: list[dict], reference: list[dict]) -> dict[str, float]:
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    rel = lambda key, a, b: abs(a[key] - b[key]) / abs(b[key])
    pairs = list(zip(records, reference))
    return {
        "step1": max(rel(key, *pairs[0]) for key in ("loss", "grad_norm")),
        "loss": max(rel("loss", a, b) for a, b in pairs),
        "grad_norm": max(rel("grad_norm", a, b) for a, b in pairs),
    }


def record(name: str, nproc: int, found: dict[str, float]) -> None:
    if os.environ.get("GPU_RESULTS"):
        with open(os.environ["GPU_RESULTS"], "a") as f:
            f.write(json.dumps({"layout": name, "gpus": nproc, **found}) + "\n")


# name: (GPUs, overrides); the global batch is 8 on every layout.
FP32_LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "hsdp2x1": (2, ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2"]),
    "tp2": (2, ["--training.local_batch_size", "8", *TP2]),
    "tp2_no_loss_parallel": (2, ["--training.local_batch_size", "8", *TP2,
                                 "--parallelism.enable_loss_parallel", "false"]),
    "pp2_1F1B": (2, ["--training.local_batch_size", "8", *PP2]),
    "pp2_Interleaved1F1B": (2, ["--training.local_batch_size", "8", *PP2, SCHEDULE, "Interleaved1F1B"]),
    "pp2_ZBVZeroBubble": (2, ["--training.local_batch_size", "8", *PP2, SCHEDULE, "ZBVZeroBubble"]),
    "cp2": (2, ["--training.local_batch_size", "8", *CP2]),
    "fsdp2_compile": (2, ["--training.local_batch_size", "4", "--compile.enable"]),
    "tp2_compile": (2, ["--training.local_batch_size", "8", *TP2, "--compile.enable"]),
    # Four GPUs and more.
    "pp2_fsdp2_1F1B": (4, ["--training.local_batch_size", "4", *PP2]),
    "pp2_fsdp2_Interleaved1F1B": (4, ["--training.local_batch_size", "4", *PP2, SCHEDULE, "Interleaved1F1B"]),
    "fsdp2_tp2": (4, ["--training.local_batch_size", "4", *TP2]),
    "pp2_tp2": (4, ["--training.local_batch_size", "8", *PP2, *TP2]),
    "cp2_tp2": (4, ["--training.local_batch_size", "8", *CP2, *TP2]),
    "pp2_fsdp2_tp2": (8, ["--training.local_batch_size", "4", *PP2, *TP2, SCHEDULE, "Interleaved1F1B"]),
    "pp2_cp2_tp2": (8, ["--training.local_batch_size", "8", *PP2, *CP2, *TP2]),
}  # fmt: skip
CASES = [pytest.param(name, marks=gpus(nproc), id=name) for name, (nproc, _) in FP32_LAYOUTS.items()]


@pytest.mark.parametrize("name", CASES)
def test_fp32_layout_matches_one_gpu(name, single, tmp_path):
    nproc, overrides = FP32_LAYOUTS[name]
    run_train([*COMMON, *FP32, *overrides, "--job.dump_folder", str(tmp_path)], nproc=nproc, torchrun=True)
    found = differences(read_metrics(tmp_path), single(FP32))
    record(name, nproc, found)
    assert found["step1"] < 1e-6 and found["loss"] < FP32_BAR and found["grad_norm"] < FP32_BAR, found


BF16_LAYOUTS = {
    "bf16_fsdp2": (2, ["--training.local_batch_size", "4"], ()),
    "bf16_tp2": (2, ["--training.local_batch_size", "8", *TP2], ()),
    "bf16_cp2": (2, ["--training.local_batch_size", "8", *CP2], ()),  # attention parts on cuDNN
    "bf16_fsdp2_float8": (2, ["--training.local_batch_size", "4", "--float8.enable",
                              "--float8.enable_fsdp_float8_all_gather"], ("--float8.enable",)),
    "bf16_tp2_float8": (2, ["--training.local_batch_size", "8", *TP2, "--float8.enable"],
                        ("--float8.enable",)),
    "bf16_tp2_async": (2, ["--training.local_batch_size", "8", *TP2, "--compile.enable",
                           "--parallelism.enable_async_tensor_parallel"], ()),  # micro-pipelined TP
    # One GPU, unwrapped: the reference computes on bf16 weight copies (training/bf16_weights.py).
    "bf16_autocast": (1, ["--training.local_batch_size", "8", "--training.bf16_weight_copies", "false"], ()),
    "bf16_copies_compile": (1, ["--training.local_batch_size", "8", "--compile.enable"], ()),
    "bf16_copies_accumulate": (1, ["--training.local_batch_size", "4"], ()),  # gradients add up in bf16
    # Muon (Newton-Schulz in bf16, as on every GPU run): sharded by FSDP, and on the copies (the
    # reference) against autocast
    "bf16_fsdp2_muon": (2, ["--training.local_batch_size", "4", "--optimizer.name", "Muon"],
                        ("--optimizer.name", "Muon")),
    "bf16_muon_autocast": (1, ["--training.local_batch_size", "8", "--optimizer.name", "Muon",
                               "--training.bf16_weight_copies", "false"], ("--optimizer.name", "Muon")),
    # float8 layers on their float32 weights against float8 on the bf16 copies (the reference)
    "bf16_float8_autocast": (1, ["--training.local_batch_size", "8", "--float8.enable",
                                 "--training.bf16_weight_copies", "false"], ("--float8.enable",)),
}  # fmt: skip


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpus(g[0]), id=n) for n, g in BF16_LAYOUTS.items()])
def test_bf16_layout_matches_one_gpu(name, single, tmp_path):
    nproc, overrides, reference_extra = BF16_LAYOUTS[name]
    run_train([*COMMON, *BF16, *overrides, "--job.dump_folder", str(tmp_path)], nproc=nproc, torchrun=True)
    found = differences(read_metrics(tmp_path), single(BF16, reference_extra))
    record(name, nproc, found)
    assert found["loss"] < BF16_BAR, found


# Document masking on short documents (~12 per window of 256): flex attention under a BlockMask.
DOCUMENTS = ("--model.attention_mask", "document", "--training.dataset", "text",
             "--training.dataset_path", SHORT_DOCUMENTS)  # fmt: skip
# Mixture of Experts (qwen3_moe debugmodel; fp32, so the per-expert loop, not grouped GEMM).
MOE = ("--model.name", "qwen3_moe")
GPT_OSS = ("--model.name", "gpt_oss")
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# name: (GPUs, overrides the one-GPU reference shares, the layout's own overrides)
VARIANT_LAYOUTS = {
    "cp2_document": (2, DOCUMENTS, ["--training.local_batch_size", "8", *CP2]),
    "pp2_document": (2, DOCUMENTS, ["--training.local_batch_size", "8", *PP2]),  # mask cut in micro-batches
    "fsdp2_compile_document": (2, DOCUMENTS, ["--training.local_batch_size", "4", "--compile.enable"]),
    "moe_ep2_fsdp2": (2, MOE, ["--training.local_batch_size", "4", *EP2]),
    "moe_ep2_compile": (2, MOE, ["--training.local_batch_size", "4", *EP2, "--compile.enable"]),
    "moe_tp2": (2, MOE, ["--training.local_batch_size", "8", *TP2]),
    "moe_pp2": (2, MOE, ["--training.local_batch_size", "8", *PP2]),
    "moe_cp2_ep2": (2, MOE, ["--training.local_batch_size", "8", *CP2, *EP2]),
    # gpt-oss (windows of 8 in blocks 0 and 2, attention sinks): flex attention under block masks.
    "gpt_oss_cp2_document": (2, (*GPT_OSS, *DOCUMENTS), ["--training.local_batch_size", "8", *CP2]),
    "gpt_oss_ep2_compile": (2, GPT_OSS, ["--training.local_batch_size", "4", *EP2, "--compile.enable"]),
}  # fmt: skip


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=gpus(g[0]), id=n) for n, g in VARIANT_LAYOUTS.items()]
)
def test_document_masking_and_moe_layouts_match_one_gpu(name, single, tmp_path):
    nproc, shared, overrides = VARIANT_LAYOUTS[name]
    run = [*COMMON, *FP32, *shared, *overrides, "--job.dump_folder", str(tmp_path)]
    run_train(run, nproc=nproc, torchrun=True)
    found = differences(read_metrics(tmp_path), single(FP32, shared))
    record(name, nproc, found)
    assert found["step1"] < 1e-6 and found["loss"] < FP32_BAR and found["grad_norm"] < FP32_BAR, found


@gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flex_document_mask_equals_the_boolean_mask(dtype, head_dim):
    """The CUDA path (a BlockMask for flex attention; on an H100/H200 in bf16 at head dimension 64
    with models.attention's tiles) against SDPA with the CPU path's boolean mask, for whole
    sequences and for a context-parallel rank's chunks; outputs and gradients."""
    torch.manual_seed(0)
    seq, eos = 1024, 7
    tokens = torch.randint(0, 64, (2, seq), device="cuda")  # EOS 1 in 64: documents of ~64 tokens
    documents = document_ids(tokens, eos)
    q = torch.randn(2, 8, seq, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, seq, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    for queries in (None, local_positions(seq, 1, 4).cuda()):
        query = q if queries is None else q[:, :, queries]
        outputs = []
        for mask in (document_mask(documents, queries), document_mask(documents.cpu(), queries).cuda()):
            leaves = [t.detach().requires_grad_() for t in (query, k, v)]
            out = masked_attention(*leaves, mask)
            out.float().square().sum().backward()
            outputs.append([out, *(t.grad for t in leaves)])
        for flex, boolean in zip(*outputs):
            if dtype == torch.float32:
                torch.testing.assert_close(flex, boolean, rtol=1e-4, atol=1e-4)
            else:  # bf16: two kernels' roundings; at head dim 128 a few of 500k gradients differ by > 5e-2
                error = (flex.float() - boolean.float()).norm() / boolean.float().norm()
                assert error < 1e-2, error


@gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_sink_attention_equals_the_boolean_mask(dtype):
    """gpt-oss's attention on CUDA (flex attention under a block mask, the sink entering through its
    log-sum-exp) against the CPU path's (scores written out, the sink one more column): causal and
    in a window of 128, with and without documents, for whole sequences and a context-parallel
    rank's chunks; outputs and the gradients of queries, keys, values and sinks."""
    torch.manual_seed(0)
    seq, eos = 1024, 7
    documents = document_ids(torch.randint(0, 64, (2, seq), device="cuda"), eos)  # ~64-token documents
    q = torch.randn(2, 8, seq, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, seq, 64, device="cuda", dtype=dtype) for _ in range(2))
    sinks = torch.randn(8, device="cuda")
    for queries in (torch.arange(seq, device="cuda"), local_positions(seq, 1, 4).cuda()):
        for window in (None, 128):
            for with_documents in (False, True):
                outputs = []
                for device in ("cuda", "cpu"):  # a block mask; the boolean mask, moved to the GPU
                    at = queries.to(device)
                    mask = document_mask(documents.to(device), at) if with_documents else causal_mask(at, seq)
                    mask = within_window(mask, at, window) if window else mask
                    mask = mask.cuda() if device == "cpu" else mask
                    leaves = [t.detach().requires_grad_() for t in (q[:, :, queries], k, v, sinks)]
                    out = sink_attention(*leaves, mask)
                    out.float().square().sum().backward()
                    outputs.append([out, *(t.grad for t in leaves)])
                for flex, boolean in zip(*outputs):
                    if dtype == torch.float32:
                        torch.testing.assert_close(flex, boolean, rtol=1e-4, atol=1e-4)
                    else:  # bf16: two kernels' roundings
                        error = (flex.float() - boolean.float()).norm() / boolean.float().norm()
                        assert error < 1e-2, (window, with_documents, error)


@gpus(1)
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_parts_on_cudnn(cp):
    """Each cp rank's causal attention, split in parts run by cuDNN and merged by log-sum-exp, put
    together equals plain SDPA (outputs and gradients, bf16)."""
    check_chunk_attention(cp, "cuda", torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})


@gpus(2)
def test_checkpoint_reshards_fsdp2_tp2_one_gpu_pp2(single, tmp_path):
    """Saved on FSDP 2, resumed on TP 2, then on one GPU, then on PP 2 (each leg from the previous
    leg's checkpoint five steps on): the loss curve of one uninterrupted run."""
    legs = [
        (2, ["--training.local_batch_size", "4"]),
        (2, ["--training.local_batch_size", "8", *TP2]),
        (1, ["--training.local_batch_size", "8"]),
        (2, ["--training.local_batch_size", "8", *PP2]),
    ]
    resumed = []
    for leg, (nproc, overrides) in enumerate(legs):
        folder = tmp_path / f"leg{leg}"
        if leg:  # start from the previous leg's checkpoint of step 5 x leg
            (folder / "checkpoint").mkdir(parents=True)
            (tmp_path / f"leg{leg - 1}/checkpoint/step-{5 * leg}").rename(
                folder / f"checkpoint/step-{5 * leg}"
            )
        saving = ["--checkpoint.enable", "--checkpoint.interval", "5", "--job.dump_folder", str(folder)]
        run_train([*COMMON, *FP32, *overrides, *saving], nproc=nproc, torchrun=True)
        resumed += [r for r in read_metrics(folder) if 5 * leg < r["step"] <= 5 * leg + 5]
    found = differences(resumed, single(FP32))
    record("reshard_fsdp2_tp2_1_pp2", 2, found)
    assert found["loss"] < FP32_BAR and found["grad_norm"] < FP32_BAR, found


@gpus(1)
@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_one_gpu_saves_resume_the_run(mode, single, tmp_path):
    """On a GPU, blocking saves are staged through page-locked host buffers (async ones always
    were), written with O_DIRECT and checksummed on the way: resuming from step 10 continues the
    uninterrupted one-GPU run (fp32 bar)."""
    folder = tmp_path / mode
    saving = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.async_mode", mode]
    run_train([*COMMON, *FP32, "--training.local_batch_size", "8", *saving, "--job.dump_folder", str(folder)])
    for later in (15, 20):
        shutil.rmtree(folder / f"checkpoint/step-{later}")
    run_train([*COMMON, *FP32, "--training.local_batch_size", "8", *saving, "--job.dump_folder", str(folder)])
    records = read_metrics(folder)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    found = differences(records[10:], single(FP32)[10:])  # (GPU kernels need not be bitwise)
    record(f"one_gpu_resume_{mode}", 1, found)
    assert found["loss"] < FP32_BAR and found["grad_norm"] < FP32_BAR, found


@gpus(1)
@pytest.mark.parametrize("snapshot", [True, False])
def test_optimizer_step_takes_over_the_host_copy_and_changes_nothing_it_copies(snapshot, monkeypatch):
    """checkpoint/fast_io/staging.py: the optimizer's pre-hook stops the staging thread part-way; the rest
    is snapshotted on the GPU (or, without room, copied straight, the optimizer waiting on the GPU).
    The update right after must not reach the host copies: they hold the values before it."""
    from checkpoint.fast_io import staging

    if not snapshot:  # no room for snapshots
        monkeypatch.setattr(staging._OverlappedCopies, "SPARE_BYTES", 1 << 50)
    weights = [torch.randn(1 << 24, device="cuda") for _ in range(24)]  # 64 MB each
    optimizer = torch.optim.SGD([torch.nn.Parameter(w) for w in weights], lr=1.0)
    stager = staging.Stager(True, True, [optimizer], lambda: {"weights": weights})
    optimizer.step()  # (no gradients: changes nothing; allocates the buffers)
    before = [w.cpu() for w in weights]
    staged = stager.stage({"weights": weights})
    stager.wait()  # the optimizer's pre-hook, right away: most copies not yet issued
    for w in weights:
        w.add_(1.0)  # the update
    copies = stager.copies
    assert copies.issued < len(copies.copies)  # the thread was stopped part-way
    for host, expected in zip(staged.result()["weights"], before):
        assert torch.equal(host, expected)


@gpus(1)
def test_snapshots_leave_the_freed_activations_to_the_next_step():
    """checkpoint/fast_io/staging.py: the take-over's snapshots take memory of the side stream's, not the
    blocks the step's activations freed into the training stream's cache, so the next step's
    activations fit in the cache as before (when the snapshots took them, the reserve grew at that
    step: slow with expandable segments, and near the memory limit a risk)."""
    from checkpoint.fast_io import staging

    torch.cuda.empty_cache()  # (the cache then holds only what this test frees)
    weights = [torch.randn(1 << 24, device="cuda") for _ in range(24)]  # 64 MB each
    optimizer = torch.optim.SGD([torch.nn.Parameter(w) for w in weights], lr=1.0)
    stager = staging.Stager(True, True, [optimizer], lambda: {"weights": weights})
    optimizer.step()
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # a step's activations, freed
    staged = stager.stage({"weights": weights})
    stager.wait()  # the take-over: most of the copies not yet issued
    assert stager.copies.snapshot_bytes > 0
    reserved = torch.cuda.memory_reserved()
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # the next step's activations
    assert torch.cuda.memory_reserved() == reserved
    staged.result()


@gpus(1)
def test_a_step_read_does_not_wait_for_another_streams_host_copies():
    """training/host_reads.py: the values read are the tensors' values (shapes kept, float64), and
    a read of a short step's result returns while a side stream's 8 GB copy to pinned host memory
    (~150 ms) is still running; an ordinary .item() waits for that copy (both checked here)."""
    from training.host_reads import to_host

    values = [
        torch.tensor(2.5, device="cuda"),
        torch.arange(6, device="cuda").view(2, 3),
        torch.tensor(True, device="cuda"),
    ]
    for read, expected in zip(to_host(*values), values):
        assert read.dtype == torch.float64 and torch.equal(read, expected.cpu().double())
    sources = [torch.ones(1 << 28, device="cuda") for _ in range(8)]  # 1 GB each
    buffers = [torch.empty(1 << 28, pin_memory=True) for _ in sources]
    a = torch.randn(4096, 4096, device="cuda")
    to_host((a @ a).sum())  # (cuBLAS's first use synchronizes the device)

    def copying_while_read(read) -> bool:
        """Whether the side stream's copy was still running when read(step result) returned."""
        torch.cuda.synchronize()
        side, done = torch.cuda.Stream(), torch.cuda.Event()
        with torch.cuda.stream(side):
            for source, buffer in zip(sources, buffers):
                buffer.copy_(source, non_blocking=True)
            done.record()
        read((a @ a).sum())
        running = not done.query()
        torch.cuda.synchronize()
        return running

    assert copying_while_read(lambda x: to_host(x))
    assert not copying_while_read(lambda x: x.item())  # (why host_reads exists)
