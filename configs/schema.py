"""The typed schema of a training config: one dataclass per TOML section.

Each field's docstring (the string literal under it) is its documentation, and each section's
check() the range checks of its fields: `python -m configs.docs --write`
renders them into docs/configuration.md, and a test fails if a field has none or that page
drifts. Key names follow torchtitan v0.2 where the concept is the same.
"""

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Literal

from configs.errors import UserError


def require(section: str, values, rules: list[tuple[str, bool, str]]) -> None:
    """Checks that types alone cannot express, next to the fields they check: (field, whether it
    holds, what the field must be); the first that fails is the user's error."""
    for name, ok, message in rules:
        if not ok:
            raise UserError(f"{section}.{name} {message} (got {getattr(values, name)!r})")


class Section:
    def check(self, section: str) -> None:
        """Range checks of this section's fields (none unless a section defines them)."""


@dataclass
class Job(Section):
    dump_folder: str = "./outputs"
    """Folder for this run's outputs: config.toml, metrics.jsonl, tb/, checkpoints."""

    description: str = ""
    """Free text describing the run; printed at start-up."""

    seed: int = 0
    """Seed for weight init and any other randomness. The same seed gives the same weights on every
    parallel layout (each parameter is drawn from its own seed derived from this and its name)."""

    dry_run: bool = False
    """Check the config and print the mesh, the parameters and the estimated memory of rank 0 (with
    pipeline parallelism, of each stage's first rank, and the largest) for dry_run_world_size
    ranks, then stop (one process, nothing trained or written)."""

    dry_run_world_size: int = 0
    """The world size a dry run checks; 0 = the processes launched."""

    signal_check_interval: int = 10
    """Every this many steps the ranks agree (one small host all-reduce) on whether any of them got
    a stop signal (SIGTERM, SIGUSR1, Ctrl-C); the run then stops after that step, saving a
    checkpoint when checkpointing is on. A single process checks every step."""

    collective_timeout_s: float = 600.0
    """Seconds a rank waits in a collective (gloo and NCCL) for the others before the run stops: a
    rank that hangs or died. gloo raises, and the run ends with one error line saying so; NCCL's
    watchdog aborts the process. Raise it for steps or checkpoint loads slower than this."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("dump_folder", self.dump_folder.strip() != "", "must not be empty"),
            ("dry_run_world_size", self.dry_run_world_size >= 0, "must be >= 0 (0 = as launched)"),
            ("signal_check_interval", self.signal_check_interval >= 1, "must be >= 1"),
            ("collective_timeout_s", self.collective_timeout_s > 0, "must be > 0"),
        ])  # fmt: skip


@dataclass
class Model(Section):
    name: str = "llama3"
    """Model family, a key of the registry in models/__init__.py."""

    flavor: str = "debugmodel"
    """Size of the model within its family (llama3: tiny, debugmodel, 1B, 3B, 8B, 70B, 405B; qwen3:
    tiny, debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B; qwen3_moe: tiny, debugmodel, debugmodel_deepseek,
    30B-A3B, 235B-A22B; deepseek_v3: tiny, debugmodel, 16B, moonlight_16B_A3B, 236B, 671B,
    kimi_k2)."""

    args: list[str] = field(default_factory=list)
    """Changes to the flavor's architecture arguments, as "name=value" strings, e.g.
    ["tie_embeddings=false"] or ["n_layers=2"] (names: the flavor's args dataclass)."""

    hf_assets_path: str = ""
    """Folder holding a Hugging Face tokenizer.json (and tokenizer_config.json). Empty: the built-in
    byte-level tokenizer (256 bytes + BOS + EOS)."""

    attention_mask: Literal["causal", "document"] = "causal"
    """causal: every token attends to all earlier tokens of its packed window. document: only to
    earlier tokens of its own document (documents end at the tokenizer's EOS, which the packer
    writes after each one); flex attention on CUDA, a boolean SDPA mask on CPU."""


@dataclass
class Training(Section):
    dataset: Literal["python_docs", "text", "tokens", "hf"] = "python_docs"
    """Data source. python_docs: the bundled sample corpus (data/sample/, no download).
    text: local .txt/.jsonl/.parquet files (dataset_path = file, folder or glob).
    tokens: token shards written by scripts/prepare_data.py (dataset_path = their folder).
    hf: a Hugging Face `datasets` dataset by name (dataset_path), streamed; needs the package."""

    dataset_path: str = ""
    """Where the data is, for dataset = text, tokens or hf (see dataset). For tokens, several shard
    folders separated by commas ("web,code,math") make a mixture (dataset_weights); each source is
    named by its folder's last component (docs/data.md)."""

    dataset_weights: str = ""
    """Weights of the token-shard folders of dataset_path, comma-separated in the same order
    ("0.6,0.3,0.1"; normalized to sum 1); empty = equal. Each global sample's source follows from
    the weights deterministically: every source stays within one sample of its share."""

    shuffle: bool = True
    """Token shards: read each source's samples in a seeded pseudo-random order (job.seed), a new
    one each epoch; false = in the order they lie on disk. Text sources are read in order."""

    allow_data_change: bool = False
    """On resume, accept other token-shard sources, weights, sizes, shuffling or seed than the
    checkpoint's: each source continues from the samples it gave, the new weights apply from the
    resumed step. Without it such a resume is refused."""

    allow_tokenizer_change: bool = False
    """Accept token shards written with another tokenizer (of the same vocabulary size) than
    model.hf_assets_path's: their ids then mean other tokens."""

    prefetch_steps: int = 2
    """Steps of micro-batches read ahead by a background thread while a step runs (pinned memory
    on CUDA); 0 = read each step when it starts. Neither the samples nor the data state change."""

    dataset_text_field: str = "text"
    """Field holding the document text in .jsonl/.parquet rows and HF datasets."""

    dataset_subset: str = ""
    """Configuration name of an HF dataset (e.g. "en" for allenai/c4); empty for none."""

    dataset_split: str = "train"
    """Split of an HF dataset."""

    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree.
    Must be a multiple of that product; the quotient is the number of gradient-accumulation steps."""

    seq_len: int = 2048
    """Tokens per sequence. Documents are packed into windows of this length, split by EOS."""

    steps: int = 10000
    """Number of optimizer steps to train for."""

    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of parameters in forward/backward on CUDA (master weights and optimizer state stay
    float32). On CPU training runs in float32 whatever this says: bf16 matmuls are far slower there."""

    bf16_weight_copies: bool = True
    """On one GPU in bf16 (no FSDP, no pipeline): the linear layers compute with bf16 copies of their
    weights, refreshed after each optimizer step, instead of autocast casting every weight in each
    forward and backward (training/bf16_weights.py; +4% on the 1B and 3B batch-1 steps on an H200, as
    measured when the AdamW update wrote the copies itself). Forward and backward compute the same;
    gradients of several micro-batches add up in bf16, as under FSDP. float8 layers cast the copies
    to float8 (as under FSDP): +2.4% on the 3B float8 batch-2 step, at 5.3 GiB more peak memory
    (79.0 -> 84.3 GiB); false gives that memory back."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction across data-parallel ranks (used by FSDP)."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: CUDA when available, else CPU."""

    nonfinite_policy: Literal["stop", "skip", "off"] = "stop"
    """A step whose loss or gradient norm is NaN/Inf never updates the weights. stop: no update from
    that step on, and the run ends at the next logged step or save with an error naming the step;
    skip: skip its update (up to max_skipped_steps); off: no check. The check runs on the device
    (no synchronization with fused AdamW)."""

    max_skipped_steps: int = 5
    """With nonfinite_policy = skip: stop once more steps than this were skipped."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("local_batch_size", self.local_batch_size >= 1, "must be >= 1"),
            ("global_batch_size", self.global_batch_size == -1 or self.global_batch_size >= 1,
             "must be >= 1, or -1 for local_batch_size x data-parallel degree"),
            ("seq_len", self.seq_len >= 1, "must be >= 1"),
            ("steps", self.steps >= 1, "must be >= 1"),
            ("max_norm", self.max_norm >= 0, "must be >= 0 (0 disables clipping)"),
            ("max_skipped_steps", self.max_skipped_steps >= 0, "must be >= 0"),
            ("prefetch_steps", self.prefetch_steps >= 0, "must be >= 0 (0 reads each step when it starts)"),
            ("dataset_path", self.dataset == "python_docs" or self.dataset_path != "",
             f"is required when training.dataset = '{self.dataset}'"),
        ])  # fmt: skip


@dataclass
class Optimizer(Section):
    name: Literal["AdamW", "Muon"] = "AdamW"
    """AdamW, or Muon for the matrices of the blocks with AdamW for the other parameters
    (embeddings, output, norms, router gates; docs/muon.md). Weight decay applies to matrices, not
    to norm weights."""

    lr: float = 8e-4
    """Peak learning rate, reached at the end of warmup (with Muon: of the AdamW parameters, and of
    the Muon ones unless muon_lr is set). The schedule scales every parameter group's."""

    beta1: float = 0.9
    """AdamW beta1."""

    beta2: float = 0.95
    """AdamW beta2."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.1
    """AdamW's decoupled weight decay for 2-D (and larger) parameters."""

    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """torch's AdamW kernel: auto = fused on CUDA, foreach on CPU. (With state_dtype bfloat16 or
    Muon, AdamW is training/adamw.py's foreach implementation.)"""

    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the optimizer's state (AdamW's moments, Muon's momentum): bfloat16 halves it, the
    arithmetic staying in float32 (training/adamw.py)."""

    muon_lr: float = 0.0
    """Muon's peak learning rate; 0 = lr (with muon_adjust_lr = "match_rms_adamw" Muon's updates
    have AdamW's RMS, so one lr serves both, as in Moonlight)."""

    muon_momentum: float = 0.95
    """Muon's momentum."""

    muon_nesterov: bool = True
    """Nesterov momentum for Muon."""

    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay."""

    muon_adjust_lr: Literal["match_rms_adamw", "original", "none"] = "match_rms_adamw"
    """Scale of Muon's lr per matrix (rows = output dimension): match_rms_adamw 0.2 x
    sqrt(max(rows, cols)), original sqrt(max(1, rows/cols)) (torch.optim.Muon's two), none 1."""

    muon_ns_steps: int = 5
    """Newton-Schulz iterations of Muon's orthogonalization."""

    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    """The quintic Newton-Schulz iteration's coefficients (a, b, c)."""

    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """dtype of the Newton-Schulz iterations: auto = bfloat16 on CUDA (as torch.optim.Muon),
    float32 on CPU."""

    muon_params: list[str] = field(default_factory=list)
    """Name patterns (fnmatch, e.g. "output.weight") of 2-D or larger parameters that Muon updates
    besides the blocks' matrices."""

    adamw_params: list[str] = field(default_factory=lambda: ["*.router.*"])
    """Name patterns of block matrices that AdamW updates under Muon (the router gates by default).
    Start-up prints which parameters get which."""

    qk_clip_threshold: float = 0.0
    """MuonClip (Kimi K2's QK-clip; any optimizer): after each step, the query and key weights of
    every attention head whose largest logit exceeded this are scaled so it would not have (Kimi
    K2: 100); 0 = off. llama3, qwen3 (through the shared QK-norm weights) and deepseek_v3; costs one
    more QK^T product per attention in forward (training/qk_clip.py); not with context parallelism."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("lr", self.lr > 0 and math.isfinite(self.lr), "must be a positive number"),
            ("qk_clip_threshold", self.qk_clip_threshold >= 0, "must be >= 0 (0 = off)"),
            ("beta1", 0 <= self.beta1 < 1, "must be in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "must be in [0, 1)"),
            ("eps", self.eps > 0, "must be > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("muon_lr", self.muon_lr >= 0 and math.isfinite(self.muon_lr), "must be >= 0 (0 = lr)"),
            ("muon_momentum", 0 <= self.muon_momentum < 1, "must be in [0, 1)"),
            ("muon_weight_decay", self.muon_weight_decay >= 0, "must be >= 0"),
            ("muon_ns_steps", self.muon_ns_steps >= 1, "must be >= 1"),
            ("muon_ns_coefficients", len(self.muon_ns_coefficients) == 3, "must hold 3 numbers (a, b, c)"),
        ])  # fmt: skip


@dataclass
class LRScheduler(Section):
    warmup_steps: int = 200
    """Steps of linear warmup from lr/(warmup_steps+1) to lr."""

    decay_ratio: float = 1.0
    """Fraction of the steps after warmup over which the lr decays, at the end of training.
    1.0 = decay straight after warmup; below 1 the lr stays flat first (warmup-stable-decay, WSD)."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from lr to lr x min_lr_factor."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of lr."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("decay_ratio", 0 < self.decay_ratio <= 1, "must be in (0, 1]"),
            ("min_lr_factor", 0 <= self.min_lr_factor <= 1, "must be in [0, 1]"),
        ])  # fmt: skip


@dataclass
class Parallelism(Section):
    data_parallel_replicate_degree: int = 1
    """HSDP replicas: groups of ranks that each hold a full (FSDP-sharded) copy of the model and
    all-reduce gradients between them. 1 = plain FSDP."""

    data_parallel_shard_degree: int = -1
    """FSDP sharding degree; -1 = every rank the other degrees leave (world size / the others)."""

    fsdp_single_device: bool = False
    """Wrap the model in FSDP even with one data-parallel rank (a single GPU), which then applies its
    mixed precision (bf16 parameters cast once per forward) instead of autocast."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free the gathered parameters after forward (re-gather in backward): default = every block but
    the last, always = also the last and the root, never = keep them (more memory, less traffic)."""

    tensor_parallel_degree: int = 1
    """Tensor parallelism (Megatron-style, with sequence parallel norms) over this many ranks."""

    enable_async_tensor_parallel: bool = False
    """With tensor parallelism, compile and CUDA: torch's micro-pipelined TP. Inductor cuts each
    sequence-parallel all-gather + matmul and matmul + reduce-scatter in the compiled blocks into
    chunks whose communication (over symmetric memory) overlaps the other chunks' matmuls."""

    enable_loss_parallel: bool = True
    """With tensor parallelism: keep logits sharded over the vocabulary and compute cross-entropy
    on the shards, instead of gathering full logits on every rank."""

    context_parallel_degree: int = 1
    """Context parallelism: every sequence is split over this many ranks (load-balanced chunks for
    causal attention; K/V all-gathered). training.seq_len must divide by 2 x this degree."""

    expert_parallel_degree: int = 1
    """Expert parallelism for Mixture-of-Experts layers: each expert's weights live on one of this
    many ranks, and tokens travel to their experts' ranks by all-to-all and back. Drawn from the
    data-parallel x context ranks (it must divide data_parallel_shard_degree x context_parallel_degree
    and the number of experts); FSDP shards the experts over the ranks it leaves."""

    pipeline_parallel_degree: int = 1
    """Pipeline parallelism: the model's layers are split into stages over this many ranks."""

    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """torch.distributed.pipelining schedule. GPipe and 1F1B run one stage per rank; the others two
    or more (virtual stages; ZBVZeroBubble and DualPipeV exactly two, placed in a V). The zero-bubble
    ones (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) are refused together with FSDP."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch. A rank's share of the global batch (local batch x
    gradient-accumulation steps) is cut into micro-batches of this size and run in one schedule."""

    pipeline_parallel_layers_per_stage: int = -1
    """Layers per stage (the embedding rides with the first, the output with the last); the number
    of stages must then be a multiple of the degree. -1 = balanced automatically, counting the
    embedding and the output as one layer each."""

    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Explicit split: the layers that start a new stage, e.g. ["layers.8", "layers.16"]. Overrides
    pipeline_parallel_layers_per_stage."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("data_parallel_replicate_degree", self.data_parallel_replicate_degree >= 1, "must be >= 1"),
            ("data_parallel_shard_degree", self.data_parallel_shard_degree == -1
             or self.data_parallel_shard_degree >= 1, "must be >= 1, or -1 (infer)"),
            ("tensor_parallel_degree", self.tensor_parallel_degree >= 1, "must be >= 1"),
            ("pipeline_parallel_degree", self.pipeline_parallel_degree >= 1, "must be >= 1"),
            ("context_parallel_degree", self.context_parallel_degree >= 1, "must be >= 1"),
            ("expert_parallel_degree", self.expert_parallel_degree >= 1, "must be >= 1"),
            ("pipeline_parallel_microbatch_size", self.pipeline_parallel_microbatch_size >= 1,
             "must be >= 1"),
            ("pipeline_parallel_layers_per_stage",
             self.pipeline_parallel_layers_per_stage == -1 or self.pipeline_parallel_layers_per_stage >= 1,
             "must be >= 1, or -1 (balanced)"),
        ])  # fmt: skip


@dataclass
class Compile(Section):
    enable: bool = False
    """torch.compile every transformer block (fullgraph unless context parallel) and the loss (not
    under TP). Costs compile time at the first step; no recompilation happens after step 2 (logged)."""

    backend: Literal["inductor", "aot_eager"] = "inductor"
    """inductor: fused generated kernels (why one compiles). aot_eager: the same graphs traced (dynamo
    and AOT autograd: graph breaks, recompilations, DTensor and hook tracing) but run with eager
    kernels, to tell whether a failure or a numerical difference lies in inductor; the CPU test suite
    checks tracing with it, where inductor's C++ compile would cost minutes."""


@dataclass
class ActivationCheckpoint(Section):
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of keeping them. full: every block keeps only
    its input. selective: see selective_ac_option."""

    selective_ac_option: str = "op"
    """With mode = selective: "op" keeps the outputs of matmuls and attention and recomputes the
    cheap element-wise work (norms, RoPE, SiLU); a number N checkpoints every N-th block fully."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("selective_ac_option", self.selective_ac_option == "op"
             or (self.selective_ac_option.isdigit() and int(self.selective_ac_option) >= 1),
             'must be "op" or a positive whole number'),
        ])  # fmt: skip


@dataclass
class Float8(Section):
    enable: bool = False
    """Float8 matmuls for the Linear layers (torchao; on CUDA needs compute capability 8.9+). With
    tensor parallelism the weights are sharded and the activations gathered in bf16, and the float8
    scales are those of the whole tensors (tested on CPU against float8 on one process)."""

    recipe_name: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao scaling recipe: one scale per tensor (fastest), or per row (more accurate)."""

    enable_fsdp_float8_all_gather: bool = False
    """tensorwise + FSDP: all-gather weights already cast to float8 (half the bytes of bf16)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """tensorwise + FSDP float8 all-gather: compute all weight scales in one pass after each
    optimizer step instead of one small reduction per layer."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router"])
    """Linear layers whose name contains any of these stay in bf16: by default the output projection
    (its accuracy matters most and the vocabulary dimension is large) and MoE routers (their scores
    decide the experts, in fp32)."""


@dataclass
class Profiling(Section):
    enable: bool = False
    """Record torch profiler traces of some steps (see start_step, steps, ranks) under profiles/."""

    start_step: int = 10
    """First profiled step (after warm-up and compilation)."""

    steps: int = 2
    """Number of consecutive steps in the trace."""

    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that record traces."""

    memory_snapshot: bool = False
    """CUDA only: also record the allocator's history and save a memory snapshot after the profiled
    steps, or when training runs out of CUDA memory."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("start_step", self.start_step >= 1, "must be >= 1"),
            ("steps", self.steps >= 1, "must be >= 1"),
        ])  # fmt: skip


@dataclass
class Validation(Section):
    enable: bool = False
    """Compute the loss (and perplexity) on held-out data every freq steps, logged as val_loss and
    val_perplexity in metrics.jsonl and TensorBoard."""

    freq: int = 500
    """Validate every this many steps (and at the last step)."""

    steps: int = 10
    """Global batches per validation: the same first ones of the validation data every time."""

    dataset: Literal["python_docs", "text", "tokens", "hf"] = "text"
    """Validation data source, as training.dataset (python_docs is for tests only: it is the
    training sample itself)."""

    dataset_path: str = ""
    """Where the validation data is (as training.dataset_path)."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("freq", self.freq >= 1, "must be >= 1"),
            ("steps", self.steps >= 1, "must be >= 1"),
        ])  # fmt: skip


RESUMING_ONLY = "has no effect unless checkpoint.enable = true (without it nothing is resumed)"


@dataclass
class Checkpoint(Section):
    enable: bool = False
    """Save checkpoints, and resume from the latest one when the same command runs again."""

    folder: str = "checkpoint"
    """Folder for checkpoints, inside job.dump_folder."""

    interval: int = 500
    """Save every this many steps (and at the last step)."""

    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (older complete ones are deleted after a new one
    is written); 0 keeps all."""

    load_step: int = -1
    """Resume from this step's checkpoint; -1 = the latest complete one. Later complete checkpoints
    are then renamed step-N.abandoned (kept, never counted or loaded), so the run continues from here."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled: training waits for the save (with fast_io on a GPU the state is first copied into
    page-locked host buffers kept for the run, as with async_with_pinned_mem). async: tensors are
    copied to host memory, then written in the background while training goes on.
    async_with_pinned_mem: the same through pinned host buffers kept for the run (faster copies from
    the GPU; with fast_io = false the same as async). Host memory: every mode but disabled keeps one
    copy of this rank's share of the checkpoint."""

    fast_io: bool = True
    """true: the fast path (checkpoint/fast_io/): host buffers kept for the run, async saves written
    by a writer process (async_writer), data files written with O_DIRECT (direct_io) and checksummed
    as written, files read back by parallel threads. false: torch's DCP as it is (FileSystemWriter,
    BlockingAsyncStager, FileSystemReader), the checksums taken by reading the files back. Both
    write the same format: either resumes from the other's checkpoints."""

    async_writer: Literal["process", "thread"] = "process"
    """fast_io only. Who writes an async save. process: a writer process per rank, started with the
    run, which reads the host copies in place (shared memory; Linux, else a thread): its Python work
    does not slow training. thread: a thread of the training process, whose Python work slows the
    training thread meanwhile (two steps at 53% of their speed on the H200, one with the process:
    docs/checkpointing.md)."""

    writer_threads: int = 8
    """Threads each rank writes its checkpoint files with (more, smaller files; DCP's
    FileSystemWriter thread_count) and, with fast_io, reads them with when loading (H200 machine:
    saves 2.54 GB/s with 8, 1.87 with 4; an 18 GB load from the page cache 3.4 s with 8 threads,
    8.6 s with DCP's one)."""

    async_min_write_mb_per_s: float = 50.0
    """The slowest write an async save is waited for: one not finished 120 s + this rank's share of
    the checkpoint at this rate (MB/s) after it began (18 GB: 480 s) is given up, and the run stops
    with an error, the previous checkpoint intact (a writer stopped or stuck in a hung filesystem
    would otherwise block training forever at the next save). Lower it for a filesystem slower than
    this per rank; 0 waits forever."""

    direct_io: bool = True
    """fast_io only. Write the data files with O_DIRECT, past the page cache, checksumming them on
    the way (checkpoint/fast_io/data_files.py): faster on local disks; a filesystem that refuses
    O_DIRECT gets ordinary writes. false: ordinary writes everywhere (e.g. where O_DIRECT is slow,
    as on some network filesystems)."""

    last_save_model_only: bool = False
    """At the last step save only the model weights (in export_dtype), e.g. for export; such a
    checkpoint can start another run (initial_load_path) but not continue this one."""

    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights in a model-only save."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not to load when resuming: any of "model", "optimizer", "train" (step,
    tokens seen, RNG), "dataloader" (the data cursor)."""

    allow_model_change: bool = False
    """Resume even though the checkpoint's model differs from this run's in architecture arguments
    (e.g. rope_theta, norm_eps), for a deliberate change: the differences are logged as a warning
    instead of stopping the run. Tensor shapes must still match."""

    allow_other_run: bool = False
    """Resume a checkpoint of another run found in this run's checkpoint folder (copied in) although
    this folder's run has an identity of its own (run_id in job.dump_folder); its saves stay this run's.
    Not needed to continue a run in a new folder (it adopts the identity of the checkpoint it
    resumes); a step folder that is a symbolic link is refused even so (docs/checkpointing.md)."""

    initial_load_path: str = ""
    """Weights to start from when there is no checkpoint to resume: a checkpoint folder (step-N) or
    a Hugging Face folder of .safetensors files (converted through the model's adapter)."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("interval", self.interval >= 1, "must be >= 1"),
            ("keep_latest_k", self.keep_latest_k >= 0, "must be >= 0 (0 keeps all)"),
            ("writer_threads", self.writer_threads >= 1, "must be >= 1"),
            ("folder", self.folder.strip() != "", "must not be empty"),
            ("exclude_from_loading",
             set(self.exclude_from_loading) <= {"model", "optimizer", "train", "dataloader"},
             "may only name model, optimizer, train, dataloader"),
            # Resuming needs enable; these keys do nothing else, so one set without it is a mistake.
            # Saving keys (interval, ...) only warn (checkpoint/saving.py): a recipe may keep them
            # with saving off and a command line turn it on.
            ("load_step", self.enable or self.load_step == -1, RESUMING_ONLY),
            ("exclude_from_loading", self.enable or not self.exclude_from_loading, RESUMING_ONLY),
            ("allow_model_change", self.enable or not self.allow_model_change, RESUMING_ONLY),
            ("allow_other_run", self.enable or not self.allow_other_run, RESUMING_ONLY),
            ("async_min_write_mb_per_s", self.async_min_write_mb_per_s >= 0, "must be >= 0 (0: no bound)"),
        ])  # fmt: skip


@dataclass
class FaultTolerance(Section):
    enable: bool = False
    """Train as one of several replica groups through torchft (pip install torchft): each group is
    its own torchrun job (FSDP/TP/PP/CP inside it), the groups all-reduce gradients in place of
    HSDP's replicas, a step in which a group fails is not committed anywhere, the others go on,
    and a restarted group copies the live state from a peer (docs/fault_tolerance.md)."""

    replica_id: int = 0
    """This group's index, 0 .. group_size - 1 (it also picks the group's share of each batch)."""

    group_size: int = 0
    """Number of replica groups (required with enable). training.global_batch_size counts the
    samples of all of them, as it counts HSDP replicas."""

    min_replica_size: int = 1
    """Groups that must take part in a step for it to be committed."""

    lighthouse: str = ""
    """Address of torchft's lighthouse (e.g. http://host:29510); empty: $TORCHFT_LIGHTHOUSE."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend between the groups; auto: nccl on GPUs, gloo on CPU."""

    timeout_seconds: float = 60.0
    """How long a collective between groups, a quorum or a peer's state transfer may take before
    the step fails."""

    semi_sync_method: Literal["none", "local_sgd"] = "none"
    """none: the groups sum their gradients at every step. local_sgd: each group takes sync_steps
    optimizer steps alone on its share of each batch, then the groups average their parameters
    (torchft's LocalSGD); only then do they communicate, and a group that is behind heals. The
    logged loss is then the group's own."""

    sync_steps: int = 20
    """With semi_sync_method local_sgd: average the groups' parameters after every this many steps
    (and after the last). checkpoint.interval must be a multiple of it."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("group_size", not self.enable or self.group_size >= 1, "must be >= 1 with enable"),
            ("sync_steps", self.sync_steps >= 1, "must be >= 1"),
            ("replica_id", 0 <= self.replica_id < max(self.group_size, 1), "must be in 0 .. group_size - 1"),
            ("min_replica_size", 1 <= self.min_replica_size <= max(self.group_size, 1),
             "must be in 1 .. group_size"),
            ("timeout_seconds", self.timeout_seconds > 0, "must be > 0"),
        ])  # fmt: skip


@dataclass
class Metrics(Section):
    log_freq: int = 10
    """Log a progress line and a metrics.jsonl record every this many steps (and on the last)."""

    enable_tensorboard: bool = True
    """Also write the metrics as TensorBoard scalars under tb/ in the dump folder."""

    log_sample_ids: bool = False
    """Also record in metrics.jsonl the global ids of the samples each logged step read (to check
    which data a run saw, e.g. across a resume on another number of ranks)."""

    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s per device for MFU; 0 = look the GPU up in a table (A100, H100,
    H200, B200). MFU is left empty (null) on a device the table does not know."""

    enable_wandb: bool = False
    """Also send TensorBoard's scalars (the same names and steps) to Weights & Biases, from rank 0
    (pip install wandb). Its files go under the dump folder unless WANDB_DIR says otherwise;
    WANDB_MODE=offline writes them only there (wandb sync uploads them later). A resumed run
    continues the same W&B run: its id is kept in <dump folder>/wandb/run_id."""

    wandb_project: str = ""
    """W&B project; empty: $WANDB_PROJECT, else W&B's default."""

    wandb_entity: str = ""
    """W&B entity (user or team); empty: $WANDB_ENTITY, else the API key's default entity."""

    wandb_run_name: str = ""
    """W&B run name; empty: $WANDB_NAME, else the dump folder's name."""

    def check(self, section: str) -> None:
        require(section, self, [
            ("log_freq", self.log_freq >= 1, "must be >= 1"),
            ("peak_tflops", self.peak_tflops >= 0, "must be >= 0 (0 = look up)"),
            ("enable_wandb", not self.enable_wandb or importlib.util.find_spec("wandb") is not None,
             "needs the wandb package: pip install wandb"),
        ])  # fmt: skip


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    metrics: Metrics = field(default_factory=Metrics)
