"""Pretrain a language model: the whole loop, top to bottom.

    python train.py --config configs/llama3_debug.toml                    # one process
    torchrun --standalone --nproc-per-node 8 train.py --config configs/llama3_8b.toml
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        train.py --config configs/llama3_70b.toml --training.steps 1000  # any key can be overridden

Where things live: configs/ (schema and loader), models/ (architectures, registry), data/ (tokenizer,
sources, packing, loader), parallelisms/ (mesh, FSDP, TP, PP, CP), training/ (process setup, init,
optimizer, loss, clipping, metrics).
"""

import time

START_TIME = time.time()  # before the heavy imports: time to first step counts them

import contextlib
import logging
import os
import sys
from pathlib import Path

import torch

from checkpoint.manager import Checkpointer
from checkpoint.preemption import PreemptionWatcher
from checkpoint.state import TrainState
from configs import UserError, config_to_toml, load_config
from data.loader import build_dataloader, plan_batches
from parallelisms import ParallelDims, parallelize
from parallelisms.compile import RecompileWatch
from parallelisms.context_parallel import local_positions, shard_sequences
from parallelisms.float8 import precompute_float8_scales
from parallelisms.fsdp import set_gradient_sync
from parallelisms.pipeline import Pipeline, pipeline_microbatches, split_model
from parallelisms.tensor_parallel import loss_parallel_context
from training import distributed, profiling
from training.dry_run import dry_run
from training.grad_clip import clip_grads_, global_grad_norm
from training.loss import IGNORE_INDEX, TokenNormalizedLoss
from training.metrics import MetricsLogger, peak_tflops
from training.model_setup import resolve_model
from training.nonfinite import NonFiniteError, NonFiniteGuard
from training.optimizer import Optimizers
from training.profiling import StepProfiler
from training.validation import Validator
from training.weight_init import init_weights, materialize

logger = logging.getLogger("train")


def train(argv: list[str]) -> None:
    config = load_config(argv)
    distributed.setup_logging()
    if config.job.dry_run:
        dry_run(config)
        return
    device = distributed.select_device(config.training.device)
    dims = ParallelDims.from_config(config.parallelism, distributed.world_size())
    distributed.init_process_group(device)
    mesh = dims.build_mesh(device.type)
    tokens_group = mesh["dp_cp"].get_group()  # ranks holding different tokens: loss sums over it
    is_logging_rank = distributed.rank() == 0
    dump_folder = Path(config.job.dump_folder)
    if is_logging_rank:
        try:
            dump_folder.mkdir(parents=True, exist_ok=True)
            (dump_folder / "config.toml").write_text(config_to_toml(config))
        except OSError as e:
            raise UserError(f"job.dump_folder '{dump_folder}' cannot be written: {e.strerror}") from None
    if config.job.description:
        logger.info(config.job.description)

    # Model: built on the meta device (no memory), parallelized, then materialized and initialized.
    spec, tokenizer, args = resolve_model(config, dims)
    with torch.device("meta"):
        model = spec.model_cls(args)
        template = spec.model_cls(args)  # unsharded reference for layout-independent init
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = model.flops_per_token(config.training.seq_len)
    # Pipeline parallelism first cuts the model into this rank's stages (keeping parameter names);
    # every part then goes through the same chain of parallelisms.
    if dims.pp_enabled:
        model_parts, stage_indices, num_stages = split_model(
            model, spec.pipeline_split(args), config.parallelism, mesh["pp"]
        )
    else:
        model_parts = [model]
    # A context-parallel rank holds some chunks of every sequence: these token positions.
    positions = None
    if dims.cp_enabled:
        positions = local_positions(config.training.seq_len, mesh["cp"].get_local_rank(), dims.cp)
    for part in model_parts:
        parallelize(part, spec, dims, mesh, config, device)
        materialize(part, device)
        init_weights(part, template, config.job.seed)
        part.init_buffers(positions)
        part.train()
    logger.info(
        f"model {spec.name} {config.model.flavor}: {num_params:,} parameters on {device}, {dims.describe()}"
    )

    # Mixed precision: FSDP casts parameters itself; an unwrapped model on CUDA uses bf16 autocast.
    # CPU runs stay in float32, where bf16 matmuls are slow.
    use_bf16 = device.type == "cuda" and config.training.mixed_precision_param == "bfloat16"
    autocast = (
        torch.autocast("cuda", torch.bfloat16)
        if use_bf16 and not dims.fsdp_enabled
        else contextlib.nullcontext()
    )
    use_loss_parallel = dims.tp_enabled and config.parallelism.enable_loss_parallel

    optimizers = Optimizers(model_parts, config.optimizer, config.lr_scheduler, config.training.steps, device)

    # Batches: global batch = local batch x data-parallel degree x gradient-accumulation steps.
    dp_degree, dp_rank = dims.dp, mesh["dp"].get_local_rank()
    global_batch, accumulation_steps = plan_batches(config.training, dp_degree)
    # Compiled only on whole local logits: not on vocabulary shards (loss parallel) nor on TP's
    # replicated logits (see FreshLocalOutput in parallelisms/tensor_parallel.py).
    loss_fn = TokenNormalizedLoss(compile=config.compile.enable and not dims.tp_enabled)
    pipeline = None
    if dims.pp_enabled:
        schedule = config.parallelism.pipeline_parallel_schedule
        microbatches = pipeline_microbatches(config, accumulation_steps)
        pipeline = Pipeline(
            model_parts, stage_indices, num_stages, mesh["pp"], device, schedule, microbatches, loss_fn
        )
    dataloader = build_dataloader(
        config.training, tokenizer, global_batch, dp_rank, dp_degree, pin_memory=device.type == "cuda"
    )
    validator = Validator(config.validation, config.training, tokenizer, global_batch, dp_rank, dp_degree)

    # Resume: the latest complete checkpoint of this run (any layout), else initial weights if given.
    train_state = TrainState(model=f"{spec.name} {config.model.flavor}")
    checkpointer = Checkpointer(
        config.checkpoint, dump_folder, model_parts, optimizers, dataloader, train_state,
        spec.state_dict_adapter(args), config.training.steps,
    )  # fmt: skip
    checkpointer.load()
    preemption = PreemptionWatcher() if config.checkpoint.enable else None

    metrics = MetricsLogger(
        str(dump_folder),
        device,
        global_batch * config.training.seq_len,
        distributed.world_size(),
        flops_per_token,
        config.training.steps,
        peak_tflops(device, config.metrics.peak_tflops),
        write=is_logging_rank,
        enable_tensorboard=config.metrics.enable_tensorboard,
    )
    logger.info(
        f"training {config.training.steps} steps: global batch {global_batch} x {config.training.seq_len} "
        f"tokens ({config.training.local_batch_size} per micro-batch x {dp_degree} data-parallel x "
        f"{accumulation_steps} accumulation), output in {dump_folder}"
    )
    max_norm = config.training.max_norm if config.training.max_norm > 0 else float("inf")
    parameters = [p for part in model_parts for p in part.parameters()]
    first_step = train_state.step + 1
    recompile_watch = RecompileWatch(config.compile.enable)
    nonfinite_guard = NonFiniteGuard(config.training.nonfinite_policy, config.training.max_skipped_steps)
    profiler = StepProfiler(config.profiling, dump_folder, distributed.rank(), device)
    metrics.start(train_state.step)

    def forward_backward(micro_batches: list[dict], train: bool = True) -> torch.Tensor:
        """This rank's part of one global batch's loss (summed over its micro-batches, each divided
        by the global token count; 0 on pipeline stages other than the last), with backward if train."""
        if positions is not None:  # a context-parallel rank keeps its chunks of each sequence
            micro_batches = [shard_sequences(batch, positions) for batch in micro_batches]
        # Each token weighs the same whatever micro-batch or rank it lands on.
        num_tokens = sum((b["labels"] != IGNORE_INDEX).sum() for b in micro_batches)
        loss_fn.num_tokens = distributed.all_reduce_sum(num_tokens.float(), tokens_group).item()
        with loss_parallel_context(use_loss_parallel), autocast, torch.set_grad_enabled(train):
            if pipeline is not None:
                # The schedule runs all of the step's micro-batches at once: one gradient reduction.
                return pipeline.step(micro_batches, train)
            batch_loss = torch.zeros((), device=device)
            for index, batch in enumerate(micro_batches):
                set_gradient_sync(model, index == len(micro_batches) - 1)
                logits = model(batch["input"].to(device, non_blocking=True))
                loss = loss_fn(logits, batch["labels"].to(device, non_blocking=True))
                del logits
                if train:
                    loss.backward()
                batch_loss += loss.detach()
            return batch_loss

    def global_loss(batch_loss: torch.Tensor) -> float:
        if dims.pp_enabled:  # only the last stage has the loss
            batch_loss = distributed.all_reduce_sum(batch_loss, mesh["pp"].get_group())
        return distributed.all_reduce_sum(batch_loss, tokens_group).item()

    for step in range(first_step, config.training.steps + 1):
        profiler.step_begins(step)
        lr = optimizers.set_lr(step)
        micro_batches = dataloader.next_step()
        step_loss = forward_backward(micro_batches)

        grad_norm = global_grad_norm(parameters, mesh["pp"].get_group() if dims.pp_enabled else None)
        if nonfinite_guard.allows_update(grad_norm, step):
            clip_grads_(parameters, max_norm, grad_norm)
            optimizers.step()
        optimizers.zero_grad()
        precompute_float8_scales(model_parts, config.float8)
        train_state.step = step
        train_state.tokens_seen += global_batch * config.training.seq_len
        profiler.step_ends(step)

        if step == first_step:
            metrics.first_step_done(START_TIME)
        if step == first_step + 1:
            recompile_watch.warmed_up()
        extra = {}
        if validator.due(step, config.training.steps):
            extra |= validator.evaluate(lambda batch: global_loss(forward_backward(batch, train=False)))
            recompile_watch.warmed_up()  # evaluation compiles its own (no-grad) graphs once
        if step % config.metrics.log_freq == 0 or step == config.training.steps or extra:
            recompile_watch.recompiles()
            if config.metrics.log_sample_ids:
                extra["sample_ids"] = distributed.gather_sample_ids(micro_batches, mesh["dp"].get_group())
            metrics.log(step, global_loss(step_loss), grad_norm.item(), lr, extra)

        if preemption is not None and preemption.requested():
            path = checkpointer.save(step, blocking=True)
            logger.info(
                f"preempted ({preemption.signal_name or 'signal on another rank'}): saved {path}; exiting"
            )
            break
        checkpointer.maybe_save(step)

    checkpointer.wait()
    metrics.close()
    if config.compile.enable:
        logger.info(
            f"torch.compile: {recompile_watch.recompiles()} frames compiled after step {first_step + 1}"
        )
    logger.info("training done")
    distributed.destroy_process_group(wait_for_peers=True)


def main() -> int:
    try:
        train(sys.argv[1:])
    except UserError as e:
        # Every rank finds the same mistake: one line per node is enough.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except torch.OutOfMemoryError:
        profiling.save_after_oom()
        raise
    finally:
        distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every file is closed and every rank has left the process group by now: skip the interpreter's
    # teardown, which takes about a second per process and, with gloo on torch 2.13, has been seen
    # to abort ("terminate called without an active exception") after a run that succeeded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
