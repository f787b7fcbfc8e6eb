"""What runs one optimizer step's forward and backward on this rank, whatever the layout.

train.py hands over the rank's micro-batches of a step; this module applies the layout to them:
context-parallel ranks keep their chunks of each sequence, pipeline stages run them through one
schedule (one gradient reduction), otherwise micro-batches run one after the other with FSDP's
gradient reduction on the last only; loss parallelism and bf16 autocast wrap forward and
backward. Losses stay on the device: the global loss is reduced only when someone reads it.
"""

import contextlib

import torch
from torch import nn

from configs.schema import JobConfig
from models.attention import document_ids, document_mask
from models.moe import set_sequences_per_step
from models.spec import multi_token_prediction
from parallelisms import ParallelDims
from parallelisms.compile import RecompileWatch
from parallelisms.context_parallel import local_positions, shard_sequences
from parallelisms.fsdp import set_gradient_sync
from parallelisms.parallel_dims import Meshes
from parallelisms.pipeline import Pipeline, pipeline_microbatches
from parallelisms.tensor_parallel import loss_parallel_context
from training import bf16_weights, distributed
from training.fault_tolerance import FaultTolerance
from training.host_reads import to_host
from training.loss import TokenNormalizedLoss
from training.model_setup import BuiltModel


class StepRunner:
    def __init__(
        self,
        model: BuiltModel,
        dims: ParallelDims,
        mesh: Meshes,
        config: JobConfig,
        device: torch.device,
        global_batch: int,
        accumulation_steps: int,
        fault_tolerance: FaultTolerance,
    ):
        self.parts: list[nn.Module] = model.parts
        self.device = device
        self.fault_tolerance = fault_tolerance
        self.positions = None  # a context-parallel rank keeps these positions of each sequence
        if dims.cp_enabled:
            self.positions = local_positions(config.training.seq_len, mesh["cp"].get_local_rank(), dims.cp)
        # Compiled only on whole local logits: not on vocabulary shards (loss parallel) nor on TP's
        # replicated logits (see FreshLocalOutput in parallelisms/tensor_parallel.py).
        mtp_depth, mtp_weight = multi_token_prediction(model.args)
        loss_backend = config.compile.backend if config.compile.enable and not dims.tp_enabled else None
        self.loss_fn = TokenNormalizedLoss(
            global_batch * config.training.seq_len, compile_backend=loss_backend,
            mtp_depth=mtp_depth, mtp_weight=mtp_weight,
        )  # fmt: skip
        self.pipeline = None
        if dims.pp_enabled:
            last_stage = model.spec.last_stage(model.args)
            self.pipeline = Pipeline(
                model.parts, model.stage_indices, model.num_stages, mesh["pp"], device,
                config.parallelism.pipeline_parallel_schedule,
                pipeline_microbatches(config, accumulation_steps), self.loss_fn,
                shared_modules=tuple(name for name in last_stage if name in model.spec.head),
            )  # fmt: skip
        # FSDP casts parameters itself; an unwrapped model computing in bf16 needs autocast.
        self.bf16_autocast = model.compute_dtype == torch.bfloat16 and not dims.fsdp_enabled
        self.loss_parallel = dims.tp_enabled and config.parallelism.enable_loss_parallel
        # The loss is summed over the ranks holding different tokens, and over pipeline stages
        # (only the last one has it).
        self.loss_groups = [mesh["dp_cp"].get_group()]
        if dims.pp_enabled:
            self.loss_groups.append(mesh["pp"].get_group())
        self.recompiles = RecompileWatch(config.compile.enable)
        # Document masking: the EOS tokens in each window end its documents.
        self.eos_id = model.tokenizer.eos_id if config.model.attention_mask == "document" else None
        for part in self.parts:  # MoE balance losses: the mean over the step's sequences, any layout
            set_sequences_per_step(part, global_batch * dims.cp)

    def gradient_holders(self) -> list[torch.Tensor]:
        """Where each parameter's gradient lands (its bf16 copy, if it has one), each parameter once:
        a pipeline's copies of a module that two stages hold count on one of them."""
        duplicates = {id(p) for p in self.pipeline.copies.duplicates()} if self.pipeline else set()
        return [p for p in bf16_weights.gradient_holders(self.parts) if id(p) not in duplicates]

    def forward_backward(self, micro_batches: list[dict]) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one step; returns this rank's share
        of the step's losses (on the device; 0 on pipeline stages other than the last): the main
        loss, then each multi-token-prediction depth's."""
        with self.recompiles.watch("train", warm_up_calls=2):
            return self._run(micro_batches, train=True)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict]) -> float:
        """The global loss of one global batch, without gradients (validation)."""
        with self.recompiles.watch("eval", warm_up_calls=1):
            return self.global_losses(self._run(micro_batches, train=False))[0]

    def global_losses(self, local_losses: torch.Tensor) -> tuple[float, dict[str, float]]:
        """The step's main loss over all ranks, and each multi-token-prediction depth's under a key
        of its own (mtp_loss_1, ...): one device reduction and one host read."""
        total = local_losses.clone()
        for group in self.loss_groups:
            total = distributed.all_reduce_sum(total, group)
        total = self.fault_tolerance.sum_over_groups(total)  # and over torchft's replica groups
        loss, *depths = to_host(total)[0].tolist()
        return loss, {f"mtp_loss_{depth}": value for depth, value in enumerate(depths, 1)}

    def _attention_mask(self, inputs: torch.Tensor):
        """None (causal), or the document mask of these whole sequences for this rank's queries."""
        if self.eos_id is None:
            return None
        documents = document_ids(inputs.to(self.device, non_blocking=True), self.eos_id)
        return document_mask(documents, self.positions)

    def _run(self, micro_batches: list[dict], train: bool) -> torch.Tensor:
        if self.pipeline is not None:  # one mask for all micro-batches: the schedule splits it
            masks = [self._attention_mask(torch.cat([batch["input"] for batch in micro_batches]))]
        else:
            masks = [self._attention_mask(batch["input"]) for batch in micro_batches]
        if self.positions is not None:
            micro_batches = [shard_sequences(batch, self.positions) for batch in micro_batches]
        autocast = torch.autocast("cuda", torch.bfloat16) if self.bf16_autocast else contextlib.nullcontext()
        with loss_parallel_context(self.loss_parallel), autocast:
            if self.pipeline is not None:
                # The schedule runs all of the step's micro-batches at once: one gradient reduction.
                self.pipeline.step(micro_batches, masks[0], train)
                return self.loss_fn.take(self.device)
            (model,) = self.parts
            for index, (batch, mask) in enumerate(zip(micro_batches, masks)):
                set_gradient_sync(model, index == len(micro_batches) - 1)
                labels = batch["labels"].to(self.device, non_blocking=True)
                # Multi-token prediction: depth d's input tokens are the labels of depth d - 1.
                ahead = {"mtp_tokens": labels[:, :-1]} if train and labels.dim() == 3 else {}
                inputs = batch["input"].to(self.device, non_blocking=True)
                output = model(inputs, attention_mask=mask, **ahead)
                loss = self.loss_fn(output, labels)
                del output
                if train:
                    loss.backward()
            return self.loss_fn.take(self.device)
