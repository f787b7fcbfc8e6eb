"""Pipeline parallelism: split the model into stages and run a torch.distributed.pipelining schedule.

A stage is the full model with the modules of other stages removed, so parameter names stay those
of the unsplit model (`layers.7.attention.wq.weight`) and checkpoints do not depend on the layout.
Gradient accumulation becomes more pipeline micro-batches: one schedule run per optimizer step, so
gradients are reduced once per step.
"""

import copy
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from configs import UserError
from configs.schema import Parallelism
from models.moe import moe_layers
from parallelisms.tied_weights import tied_parameter_names

SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
SINGLE_STAGE = {"GPipe", "1F1B"}  # one stage per rank; the others take several ("virtual") stages
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}  # rank r holds stages r and 2 x pp - 1 - r
# These split backward into input- and weight-gradient passes; with FSDP2 the weight gradients of
# middle stages come out wrong (measured on torch 2.13, CPU), so that combination is refused.
SPLIT_BACKWARD = {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}


def check_schedule(config: Parallelism, fsdp_enabled: bool) -> None:
    if config.pipeline_parallel_schedule in SPLIT_BACKWARD and fsdp_enabled:
        raise UserError(
            f"pipeline_parallel_schedule {config.pipeline_parallel_schedule} with FSDP gives wrong "
            "gradients (torch splits backward in a way FSDP2 does not support); use Interleaved1F1B "
            "or 1F1B, or no data parallelism"
        )


def pipeline_microbatches(config, accumulation_steps: int) -> int:
    """Pipeline micro-batches per step: the rank's local batch x accumulation steps, cut in sizes."""
    local, size = config.training.local_batch_size, config.parallelism.pipeline_parallel_microbatch_size
    if local % size:
        raise UserError(
            f"parallelism.pipeline_parallel_microbatch_size ({size}) must divide "
            f"training.local_batch_size ({local})"
        )
    return local // size * accumulation_steps


def stage_module_names(
    head: list[str], layers: list[str], tail: list[str], config: Parallelism, pp_degree: int
) -> list[list[str]]:
    """Module names of every stage, in order.

    Default: stages balanced over the layers, with the head (embedding) and the tail (final norm,
    output projection and loss) each counted as one layer. Or explicit: a number of layers per stage,
    or split points (the layers that start a new stage).
    """
    name = config.pipeline_parallel_schedule
    if config.pipeline_parallel_split_points:
        starts = config.pipeline_parallel_split_points
        unknown = [s for s in starts if s not in layers]
        if unknown:
            raise UserError(
                f"parallelism.pipeline_parallel_split_points: {unknown} are not layers ({layers[0]} ...)"
            )
        bounds = [0, *sorted(layers.index(s) for s in starts), len(layers)]
        groups = [layers[a:b] for a, b in zip(bounds, bounds[1:])]
    elif config.pipeline_parallel_layers_per_stage > 0:
        k = config.pipeline_parallel_layers_per_stage
        groups = [layers[i : i + k] for i in range(0, len(layers), k)]
    else:
        num_stages = pp_degree * (1 if name in SINGLE_STAGE else 2)
        return _balanced_groups([*head, *layers, *tail], num_stages, len(head), len(tail))
    if any(not g for g in groups):
        raise UserError("parallelism.pipeline_parallel_split_points leave a stage without layers")
    groups[0] = [*head, *groups[0]]
    groups[-1] = [*groups[-1], *tail]
    return groups


def _balanced_groups(units: list[str], num_stages: int, head: int, tail: int) -> list[list[str]]:
    # The head and the tail count as one unit each, whatever number of modules they have.
    weighted = [units[:head], *[[u] for u in units[head : len(units) - tail]], units[len(units) - tail :]]
    if len(weighted) < num_stages:
        raise UserError(
            f"{num_stages} pipeline stages need at least {num_stages - 2} layers; the model has "
            f"{len(weighted) - 2}"
        )
    base, extra = divmod(len(weighted), num_stages)
    # Extra units go to the stages after the first, which keeps the most activations in flight.
    sizes = [base + (1 if 1 <= i <= extra else 0) for i in range(num_stages)]
    groups, start = [], 0
    for size in sizes:
        groups.append([name for unit in weighted[start : start + size] for name in unit])
        start += size
    return groups


def stages_of_rank(pp_rank: int, pp_degree: int, num_stages: int, schedule: str) -> list[int]:
    if num_stages % pp_degree:
        raise UserError(
            f"{num_stages} pipeline stages do not divide over pipeline_parallel_degree {pp_degree}"
        )
    per_rank = num_stages // pp_degree
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise UserError(f"{schedule} runs one stage per rank, but the split gives {per_rank} per rank")
    if schedule in V_SHAPED:
        if per_rank != 2:
            raise UserError(f"{schedule} runs two stages per rank, but the split gives {per_rank}")
        return [pp_rank, num_stages - 1 - pp_rank]
    return [pp_rank + i * pp_degree for i in range(per_rank)]


def keep_only(model: nn.Module, keep: list[str], candidates: list[str]) -> nn.Module:
    """A copy of (meta-device) model without the candidate modules not in keep."""
    stage = copy.deepcopy(model)
    for name in candidates:
        if name in keep:
            continue
        parent, _, child = name.rpartition(".")
        container = stage.get_submodule(parent)
        if isinstance(container, nn.ModuleDict):
            del container[child]
        else:
            setattr(container, child, None)  # the model's forward skips a missing head or tail
    return stage


def split_model(
    model: nn.Module,
    head: tuple[str, ...],
    tail: tuple[str, ...],
    config: Parallelism,
    pp_mesh: DeviceMesh,
    last_stage: tuple[str, ...] = (),
) -> tuple[list[nn.Module], list[int], int]:
    """This rank's stages (copies of the model holding only their modules), their stage indices,
    and the total number of stages. head/tail: the modules before and after model.layers;
    last_stage: more modules the last stage holds (ModelSpec.last_stage): blocks that go with the
    tail, and head modules it holds as well as the first stage (StageCopies keeps them equal)."""
    with_tail = [name for name in last_stage if name.startswith("layers.")]
    head, tail = list(head), [*with_tail, *tail]
    layers = [f"layers.{key}" for key in model.layers if f"layers.{key}" not in with_tail]
    groups = stage_module_names(head, layers, tail, config, pp_mesh.size())
    groups[-1] += [name for name in last_stage if name in head]
    _check_tied_weights_within_stages(model, groups)
    indices = stages_of_rank(
        pp_mesh.get_local_rank(), pp_mesh.size(), len(groups), config.pipeline_parallel_schedule
    )
    candidates = [*head, *layers, *tail]
    return [keep_only(model, groups[i], candidates) for i in indices], indices, len(groups)


def _check_tied_weights_within_stages(model: nn.Module, groups: list[list[str]]) -> None:
    """One parameter under two names (tied embedding and output) must live on one stage: split, it
    would become two parameters that nothing keeps equal (and the copy would not be initialized)."""
    stage_of = {module: index for index, names in enumerate(groups) for module in names}
    for names in tied_parameter_names(model):
        stages = {
            stage_of.get(module) for name in names for module in stage_of if name.startswith(module + ".")
        }
        if len(stages) > 1:
            raise UserError(
                f"{' and '.join(names)} are one tied parameter but fall on different pipeline stages; "
                "untie them (e.g. --model.args tie_embeddings=false) or run without pipeline parallelism"
            )


class ShapeInferenceCounts:
    """Mixture-of-Experts statistics (token counts, balance losses) must cover the step's
    micro-batches only, but on the first step torch.distributed.pipelining runs each stage once
    more, first, to infer the shapes it sends (a forward of the first micro-batch or of empty
    tensors, whose contents are whatever memory held: the balance loss can come out NaN). torch
    2.13 keeps what that forward adds to the layers' buffers; torch 2.14 puts the buffers back
    afterwards. So the buffers are watched stage forward by stage forward through the
    first step (hooks on the stage module, outside the compiled blocks), and then each layer's set
    to what its stage's last n_microbatches counting forwards added: right whichever torch ran."""

    def __init__(self, parts: list[nn.Module]):
        self.layers = {part: list(moe_layers(part).values()) for part in parts}
        self.before: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.added = {moe: [] for layers in self.layers.values() for moe in layers}
        self.hooks = []
        for part, layers in self.layers.items():
            if layers:
                self.hooks.append(part.register_forward_pre_hook(self._entering))
                self.hooks.append(part.register_forward_hook(self._leaving))

    @staticmethod
    def _buffers(moe: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return moe.tokens_per_expert.clone(), moe.aux_loss.clone()

    def _entering(self, part: nn.Module, inputs) -> None:
        """Each forward counts from zero: what it adds is then read directly, not as a difference,
        which a NaN from the empty tensors' forward would turn into NaN for every later one."""
        self.before[part] = [self._buffers(moe) for moe in self.layers[part]]
        for moe in self.layers[part]:
            moe.tokens_per_expert.zero_()
            moe.aux_loss.zero_()

    def _leaving(self, part: nn.Module, inputs, output) -> None:
        for moe, (counts_before, aux_before) in zip(self.layers[part], self.before.pop(part)):
            counts, aux = self._buffers(moe)
            # Forwards that counted (not evaluation, not activation checkpointing's recomputation).
            if counts.any():
                self.added[moe].append((counts, aux))
            moe.tokens_per_expert.copy_(counts_before + counts)
            moe.aux_loss.copy_(aux_before + aux)

    def take_back(self, n_microbatches: int) -> None:
        """After the first training step (later calls do nothing)."""
        for moe, added in self.added.items():
            if len(added) > n_microbatches:
                counts, aux_losses = zip(*added[-n_microbatches:])
                moe.tokens_per_expert.copy_(torch.stack(counts).sum(0))
                moe.aux_loss.copy_(torch.stack(aux_losses).sum(0))
        for hook in self.hooks:
            hook.remove()
        self.layers, self.before, self.added, self.hooks = {}, {}, {}, []


class StageCopies:
    """Parameters that the first and the last stage both hold (ModelSpec.last_stage's head modules,
    e.g. the embedding DeepSeek-V3's multi-token prediction reads on the last stage). The two
    copies start equal (init is seeded by name) and stay equal: after every backward each gets the
    sum of both stages' gradients, so the same update follows; the last stage's copy is left out of
    the gradient norm, which counts the parameter once. The two stages' ranks exchange gradients
    directly (local shards: both stages shard alike over data and tensor parallelism)."""

    def __init__(self, parts: list[nn.Module], indices: list[int], num_stages: int, pp_mesh: DeviceMesh,
                 schedule: str, modules: tuple[str, ...]):  # fmt: skip
        def holding(stage: int) -> list[nn.Parameter]:
            if stage not in indices:
                return []
            part = parts[indices.index(stage)]
            return [p for name, p in part.named_parameters() if name.split(".")[0] in modules]

        self.first, self.last = holding(0), holding(num_stages - 1)
        # The last stage's pipeline rank (V-shaped schedules put it beside the first, on rank 0).
        last_rank = 0 if schedule in V_SHAPED else (num_stages - 1) % pp_mesh.size()
        self.group = pp_mesh.get_group()
        self.peer = None
        if (self.first or self.last) and last_rank != 0:
            self.peer = dist.get_global_rank(self.group, last_rank if self.first else 0)

    def duplicates(self) -> list[nn.Parameter]:
        """The copies the gradient norm leaves out."""
        return self.last

    @torch.no_grad()
    def sum_gradients(self) -> None:
        mine = [_local(p.grad) for p in self.first or self.last]
        if not mine:
            return
        if self.peer is None:  # both stages on this rank
            for first, last in zip(mine, [_local(p.grad) for p in self.last]):
                first.add_(last)
                last.copy_(first)
            return
        theirs = [torch.empty_like(grad) for grad in mine]
        operations = [dist.P2POp(dist.isend, grad.contiguous(), self.peer, self.group) for grad in mine]
        operations += [dist.P2POp(dist.irecv, buffer, self.peer, self.group) for buffer in theirs]
        for work in dist.batch_isend_irecv(operations):
            work.wait()
        for grad, other in zip(mine, theirs):
            grad.add_(other)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(type(tensor), "to_local") else tensor


class Pipeline:
    """Runs one optimizer step's micro-batches through this rank's stages."""

    def __init__(
        self,
        parts: list[nn.Module],
        indices: list[int],
        num_stages: int,
        pp_mesh: DeviceMesh,
        device: torch.device,
        schedule_name: str,
        n_microbatches: int,
        loss_fn,
        shared_modules: tuple[str, ...] = (),
    ):
        """shared_modules: head modules the last stage holds too (StageCopies)."""
        stages = [
            PipelineStage(part, index, num_stages, device, group=pp_mesh.get_group())
            for part, index in zip(parts, indices)
        ]
        schedule_cls = SCHEDULES[schedule_name]
        try:
            # The loss is normalized by the global token count already: no per-micro-batch scaling.
            self.schedule = schedule_cls(
                stages[0] if schedule_name in SINGLE_STAGE else stages,
                n_microbatches=n_microbatches,
                loss_fn=loss_fn,
                scale_grads=False,
            )
        except ValueError as e:
            raise UserError(
                f"pipeline schedule {schedule_name} with {n_microbatches} micro-batches: {e}"
            ) from None
        self.loss_fn, self.stepped = loss_fn, False
        self.has_first = 0 in indices
        self.has_last = num_stages - 1 in indices
        self.device = device
        self.n_microbatches = n_microbatches
        self.shape_inference = ShapeInferenceCounts(parts)
        self.copies = StageCopies(parts, indices, num_stages, pp_mesh, schedule_name, shared_modules)
        # Newer torch can skip gathering the last stage's outputs (full logits) after the step.
        self.step_options = (
            {"return_outputs": False}
            if "return_outputs" in inspect.signature(self.schedule.step).parameters
            else {}
        )

    def step(self, micro_batches: list[dict], attention_mask=None, train: bool = True) -> None:
        """Forward (and with train, backward) of all micro-batches; the loss function (on the last
        stage) keeps their losses. attention_mask: of all micro-batches' sequences (None: causal);
        the schedule cuts it into micro-batches like the inputs and gives each stage its part, as
        it does the multi-token prediction's tokens ahead (the labels of the depth before)."""
        inputs = torch.cat([b["input"] for b in micro_batches]).to(self.device)
        labels = torch.cat([b["labels"] for b in micro_batches]).to(self.device)
        kwargs = {"target": labels} if self.has_last else {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if train and labels.dim() == 3:
            kwargs["mtp_tokens"] = labels[:, :-1]
        run = self.schedule.step if train else self.schedule.eval
        options = self.step_options if train else {}
        if self.has_first:
            run(inputs, **kwargs, **options)
        else:
            run(**kwargs, **options)
        if train:
            if not self.stepped:  # the first step: drop the loss its shape inference computed
                self.loss_fn.keep_last(self.n_microbatches)
                self.stepped = True
            self.shape_inference.take_back(self.n_microbatches)
            self.copies.sum_gradients()
