"""Pretrain a language model: the whole loop, top to bottom.

    python train.py --config configs/llama3_debug.toml                    # one process, any machine
    python train.py --config configs/llama3_debug.toml --training.steps 200 --optimizer.lr=1e-3
    torchrun --standalone --nproc-per-node 8 train.py --config configs/llama3_8b.toml
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        train.py --config configs/llama3_70b.toml --parallelism.tensor_parallel_degree 8
    python train.py --config configs/llama3_70b.toml --job.dry_run --job.dry_run_world_size 64

--config names a recipe (configs/*.toml); any key can then be overridden as --section.key VALUE or
--section.key=VALUE (booleans also bare: --checkpoint.enable; lists as a,b or [1, 2]). Every key,
its default and meaning: docs/configuration.md (from configs/schema.py). Run the same command
again to resume from the latest checkpoint (--checkpoint.enable).

Where things live: configs/ (schema and loader), models/ (architectures, the contract in spec.py,
registry), data/ (tokenizer, sources, packing, loader), parallelisms/ (mesh, FSDP, TP, PP, CP,
compile, float8), training/ (process set-up, model building, one step's forward and backward,
optimizer, clipping, metrics), checkpoint/ (saving, resuming, Hugging Face files).
"""

import sys
import time

START_TIME = time.time()  # before the heavy imports: time to first step counts them

from configs import UserError, load_config
from configs.errors import claims_error_line
from configs.schema import JobConfig


def read_command_line(argv: list[str]) -> JobConfig:
    """The run's config; --help, a missing --config and config mistakes end here."""
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        raise SystemExit(0)
    if not any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        raise UserError(
            "no --config given: name a recipe, e.g. python train.py --config configs/llama3_debug.toml "
            "(python train.py --help shows how)"
        )
    return load_config(argv)


def report_error(message: str, code: int = 2) -> int:
    # Every rank finds the same mistake: one line per node, from whichever process gets there first.
    if claims_error_line():
        print(f"error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    # --help and config mistakes are answered before the heavy imports below (torch alone takes
    # seconds to import, tens of seconds on a busy machine); main() reads the command line again.
    try:
        read_command_line(sys.argv[1:])
    except UserError as e:
        sys.exit(report_error(str(e)))

import dataclasses
import gc
import logging
from pathlib import Path

import torch

from checkpoint.manager import Checkpointer
from checkpoint.state import TrainState
from data.loader import build_dataloader, plan_batches
from data.tokenizer import describe as describe_tokenizer
from models.spec import multi_token_prediction
from parallelisms import ParallelDims
from parallelisms.float8 import precompute_float8_scales
from training import bf16_weights, distributed, profiling, run_folder
from training.dry_run import dry_run
from training.expert_balance import ExpertBalance
from training.fault_tolerance import FaultTolerance, NoQuorum
from training.grad_clip import clip_divisor, global_grad_norm
from training.host_reads import read_float
from training.metrics import MetricsLogger, peak_tflops
from training.model_setup import build_model
from training.nonfinite import NonFiniteError, NonFiniteGuard
from training.optimizer import Optimizers
from training.profiling import StepProfiler
from training.qk_clip import qk_clip_for
from training.step import StepRunner
from training.stop_signals import StopSignals
from training.validation import Validator
from training.wandb_writer import open_wandb

logger = logging.getLogger("train")


def train(config: JobConfig) -> int:
    distributed.setup_logging()
    if config.job.dry_run:
        dry_run(config)
        return 0
    # SIGTERM, SIGUSR1 and Ctrl-C from here on stop the run cleanly: after a step, or, during start-up
    # (the model built, the checkpoint loaded), before the first one.
    stop_signals = StopSignals(config.job.signal_check_interval)
    device = distributed.select_device(config.training.device)
    dims = ParallelDims.from_config(config.parallelism, distributed.world_size())
    if config.fault_tolerance.enable:  # torchft's gradient hook is on FSDP units: FSDP wraps one device too
        dims = dataclasses.replace(dims, fsdp_single_device=True)
    distributed.init_process_group(device, config.job.collective_timeout_s)
    mesh = dims.build_mesh(device.type)
    is_logging_rank = distributed.rank() == 0
    dump_folder = Path(config.job.dump_folder)
    if config.job.description:
        logger.info(config.job.description)
    # One run per folder (training/run_folder.py): the folder checked and locked until exit; the
    # rerun of a finished run (its checkpoint at training.steps) ends here.
    run = run_folder.claim(config)
    if run.finished:
        distributed.destroy_process_group(wait_for_peers=True)
        return 0

    # Model: built on the meta device, split into pipeline stages, parallelized (training/
    # model_setup.py and parallelisms/__init__.py say in which order), materialized, initialized.
    model = build_model(config, dims, mesh, device)
    logger.info(
        f"model {model.spec.name} {config.model.flavor}: {model.num_params:,} parameters on {device}, "
        f"{dims.describe()}"
    )
    # MuonClip, if on: attention heads whose logits grew too large are scaled down after each update.
    qk_clip = qk_clip_for(model.parts, config.optimizer.qk_clip_threshold, dims, mesh, device)
    optimizers = Optimizers(
        model.parts, config.optimizer, config.lr_scheduler, config.training.steps, device, qk_clip
    )

    # Batches: global batch = local batch x data-parallel degree x gradient-accumulation steps.
    # Replica groups of fault tolerance (torchft) read their shares of one global batch, as HSDP's.
    checkpoint_interval = config.checkpoint.interval if config.checkpoint.enable else 0
    fault_tolerance = FaultTolerance(config.fault_tolerance, device, dims.dp_replicate, checkpoint_interval)
    dp_degree, dp_rank = fault_tolerance.data_parallel(dims.dp, mesh["dp"].get_local_rank())
    global_batch, accumulation_steps = plan_batches(config.training, dp_degree)
    tokens_per_step = global_batch * config.training.seq_len
    dataloader = build_dataloader(  # with multi-token prediction each sample holds the tokens ahead too
        config.training, model.tokenizer, global_batch, dp_rank, dp_degree, pin_memory=device.type == "cuda",
        extra_tokens=multi_token_prediction(model.args)[0], seed=config.job.seed,
        prefetch_steps=config.training.prefetch_steps,  # read by a thread while steps run
    )  # fmt: skip
    tokenizer = describe_tokenizer(model.tokenizer, config.model.hf_assets_path)
    logger.info(f"data: {dataloader.summary()}; tokenizer: {tokenizer}")  # what this run reads
    validator = Validator(
        config.validation, config.training, model.tokenizer, global_batch, dp_rank, dp_degree, config.job.seed
    )
    step_runner = StepRunner(  # a loss normalized by the tokens of the samples the update uses
        model, dims, mesh, config, device, fault_tolerance.loss_batch(global_batch), accumulation_steps,
        fault_tolerance,
    )  # fmt: skip

    # Resume: the latest complete checkpoint of this run (any layout), else initial weights if given.
    train_state = TrainState(model=TrainState.describe(model.spec.name, model.args))
    checkpointer = Checkpointer(
        config.checkpoint, dump_folder, model.parts, optimizers, dataloader, train_state,
        model.spec.adapter(model.args), config.training.steps,
        saves_here=fault_tolerance.writes_checkpoints,  # with fault tolerance one replica group saves
        stop_requested=lambda: stop_signals.received,  # a wait for a stuck background save ends on one
    )  # fmt: skip
    resumed = checkpointer.load()
    bf16_weights.refresh(model.parts)  # the bf16 copies of the loaded weights, if the layers have any
    fault_tolerance.register_state(
        model.parts, optimizers, dataloader, train_state, before_load=checkpointer.before_state_changes
    )
    fault_tolerance.combine_groups(model.parts, optimizers)

    # Every check has passed: only now are records written (a run that continues none sets the
    # earlier ones aside in previous-<n>/; each replica group of fault tolerance keeps its own).
    run_folder.start_records(run, config, resumed, train_state.step)
    metrics = MetricsLogger(
        str(run.record_folder), device, tokens_per_step, distributed.world_size() * fault_tolerance.groups,
        model.flops_per_token, config.training.steps, peak_tflops(device, config.metrics.peak_tflops),
        config.metrics.log_freq, write=is_logging_rank, enable_tensorboard=config.metrics.enable_tensorboard,
        resumed_step=None if fault_tolerance.enabled else train_state.step,
        wandb=open_wandb(config, run.record_folder),  # rank 0's W&B run, with metrics.enable_wandb
    )  # fmt: skip
    first_step, last_step = train_state.step + 1, config.training.steps
    logger.info(
        f"training steps {first_step} to {last_step}: global batch {global_batch} x "
        f"{config.training.seq_len} tokens ({config.training.local_batch_size} per micro-batch x "
        f"{dp_degree} data-parallel x {accumulation_steps} accumulation), output in {dump_folder}"
    )
    gradient_holders = step_runner.gradient_holders()  # for the gradient norm
    pp_group = mesh["pp"].get_group() if dims.pp_enabled else None
    nonfinite_guard = NonFiniteGuard(
        config.training.nonfinite_policy, config.training.max_skipped_steps, device
    )
    expert_balance = ExpertBalance(
        model.parts, mesh["dp_cp"].get_group(), pp_group, before_bias_update=checkpointer.before_state_changes
    )
    profiler = StepProfiler(config.profiling, dump_folder, distributed.rank(), device)
    restart_clock = lambda: metrics.start(train_state.step)  # the state was replaced (fault tolerance)
    restart_clock()
    stopped = stop_signals.stopped_during_start_up(first_step, resumed)  # then no step runs, none is saved

    # With fault tolerance the replica groups agree on each step (training/fault_tolerance.py): a
    # group that is behind copies a live peer's state as the step begins, and a step broken by a
    # group's failure ends at commit() with no update anywhere. Without it these calls do nothing.
    while not stopped and train_state.step < last_step:
        with fault_tolerance.step(on_new_state=restart_clock):
            step = train_state.step + 1
            profiler.step_begins(step)
            lr = optimizers.set_lr(step)
            micro_batches = dataloader.next_step()
            step_loss = step_runner.forward_backward(micro_batches)
            grad_norm = global_grad_norm(gradient_holders, pp_group)
            fault_tolerance.commit(optimizers)
            optimizers.step(  # both decided on the device; clipping is applied by the update
                skip=nonfinite_guard.skip_update(grad_norm, step),
                clip=clip_divisor(grad_norm, config.training.max_norm),
            )
            optimizers.zero_grad()
            expert_balance.after_step()  # MoE: expert bias update from the step's token counts
            precompute_float8_scales(model.parts, config.float8)
            train_state.step = step
            train_state.tokens_seen += fault_tolerance.tokens_used(tokens_per_step)
            profiler.step_ends(step)
            fault_tolerance.sync(step, last_step, on_new_state=restart_clock)  # local_sgd's averaging

            if step == first_step:
                metrics.first_step_done(step, START_TIME)
            if metrics.due(step):  # the only step-end reads of the device: every log_freq steps
                nonfinite_guard.check()
                loss, extra = step_runner.global_losses(step_loss)  # and each MTP depth's apart
                extra |= expert_balance.statistics() | dataloader.accounting()  # samples per source
                if config.metrics.log_sample_ids:
                    extra["sample_ids"] = distributed.gather_sample_ids(micro_batches, mesh["dp"].get_group())
                metrics.log(step, loss, read_float(grad_norm), lr, extra)
            if validator.due(step, last_step):
                with metrics.paused():
                    metrics.log_validation(step, validator.evaluate(step_runner.evaluate))
            stopping = stop_signals.requested(step)
            saving = checkpointer.due(step, stopping)
            if saving:
                nonfinite_guard.check()  # an update held back by a non-finite step is never saved
                with metrics.paused():
                    checkpointer.save(step, blocking=stopping)
            if stopping:
                saved = f"saved {checkpointer.path(step)}" if saving else "no checkpoint saved"
                logger.info(f"stopped by {stop_signals.name} after step {step}: {saved}")
                break

    nonfinite_guard.check()
    dataloader.close()  # stops reading ahead
    checkpointer.close()
    metrics.close()
    fault_tolerance.close()
    if config.compile.enable:
        graphs = step_runner.recompiles.recompiled
        logger.info(f"torch.compile: {graphs} graph{'s' * (graphs != 1)} compiled after step 2")
    logger.info("training done" if not stop_signals.name else "training stopped")
    distributed.destroy_process_group(wait_for_peers=True)
    return 130 if stop_signals.name == "SIGINT" else 0


def main() -> int:
    try:
        return train(read_command_line(sys.argv[1:]))
    except UserError as e:
        return report_error(str(e))
    except (NonFiniteError, NoQuorum) as e:  # failures, not mistakes: exit 1
        return report_error(str(e), code=1)
    except RuntimeError as e:  # a collective that another rank never joined: say so, not a traceback
        if (peer := distributed.peer_failure(e)) is None:
            raise
        return report_error(peer, code=1)
    except torch.OutOfMemoryError:
        profiling.save_after_oom()
        raise
    finally:
        distributed.destroy_process_group()
        run_folder.release()  # the dump folder's lock


if __name__ == "__main__":
    code = main()
    # Python's exit walks every object still alive for cycles; with torch's distributed and compiler
    # modules loaded that took 0.7 s of a 4.8-s tiny run on CPU, for nothing: the process is ending.
    gc.freeze()
    sys.exit(code)
