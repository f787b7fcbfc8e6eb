"""Fault tolerance through torchft: replica groups that lose a member, keep training, and heal it.

Each replica group is its own torchrun job with its own parallelism inside (FSDP, TP, PP, CP); the
groups take HSDP's replicate dimension: after FSDP's reduce-scatter inside a group, each gradient
shard is all-reduced between the groups through torchft's managed process group (a hook on every
FSDP unit, so FSDP wraps even one device). Every step starts with a quorum of the live groups
(torchft's lighthouse decides it); a group whose state is behind, e.g. restarted after a failure,
copies it from a live peer there: model, optimizer, step, tokens seen, RNG and data cursor. The
step is committed (the optimizer updates) only if no group failed during it; otherwise no group
updates and the loop runs the step again with the next samples. Disabled, every method is a no-op
and the loop runs as without it.

Semi-synchronous (semi_sync_method = "local_sgd", torchft's LocalSGD): the groups do not talk at
each step. Each trains alone on its share of every batch (its loss normalized by its own tokens)
and after every sync_steps-th step they average their parameters; the quorum, and the healing of a
group that is behind, happen there. A group that fails between syncs costs the others nothing.

Data: the groups read one global sample order as HSDP replicas do, group g the slices of
data-parallel ranks g x dp ... (g + 1) x dp - 1. A step's loss is normalized by the tokens of the
whole global batch, so the groups' gradients are summed: all-reduced as a mean over the live groups
times group_size, which with every group alive is the sum, and with fewer is the mean gradient of
the samples that were read. The samples of a dead group's slices, and of a step that failed, are
skipped, never read twice (docs/fault_tolerance.md).

The lighthouse: a quorum that cannot reach it is retried for timeout_seconds (a lighthouse started
again at its address meanwhile lets the groups go on); after that the group stops with one line.
"""

import contextlib
import logging
import math
import os
import socket
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from checkpoint.state import load_model_state, load_optimizer_state, model_state, optimizer_state
from configs import UserError
from configs.schema import FaultTolerance as Config
from models.moe import moe_layers
from training import distributed

logger = logging.getLogger(__name__)


def record_folder(dump_folder: Path, config: Config) -> Path:
    """Where a run's metrics.jsonl, tb/ and config.toml go: each replica group keeps its own in
    replica_<id>/ (checkpoints are shared: one group writes them into the dump folder's)."""
    return dump_folder / f"replica_{config.replica_id}" if config.enable else dump_folder


class NoQuorum(Exception):
    """No quorum of replica groups formed within fault_tolerance.timeout_seconds (the lighthouse
    gone, or too few groups up): this group stops, with one `error:` line (exit 1)."""


class StepAbandoned(Exception):
    """A step ended early among replica groups: a group failed during it (no group updates), or
    this group healed from a peer at a local_sgd sync (its state is now the peer's). The loop goes
    on with its next step; nothing of this one is logged or saved."""


def noting_members(process_group: type) -> type:
    """torchft's process group class, noting which replica groups the quorum it was last configured
    for holds (to name a group that is lost): torchft gives configure() every member's global rank,
    replica id x ranks per group + group rank."""

    class NotingMembers(process_group):
        replica_groups: tuple[int, ...] = ()

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None) -> None:  # fmt: skip
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                              group_world_size, global_ranks)  # fmt: skip
            if global_ranks and group_world_size:
                self.replica_groups = tuple(sorted({r // group_world_size for r in global_ranks}))

    return NotingMembers


def not_a_lost_peer(record: logging.LogRecord) -> bool:
    """False for torchft's traceback of a collective that a lost peer broke (a group killed or
    gone): the loop says that in one line, naming the group."""
    error = record.exc_info[1] if record.exc_info else None
    return error is None or distributed.peer_failure(error) is None


def quiet_torchft_logs() -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    # Its Python side logs every commit at info, and every step and quorum as a record for
    # OpenTelemetry (an empty message with fields) that our format prints as an empty line.
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("torchft.manager").addFilter(not_a_lost_peer)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # its transfers


def reachable(address: str) -> bool:
    """Whether something accepts connections at address (http://host:port)."""
    url = urllib.parse.urlsplit(address)
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=5).close()
        return True
    except (OSError, ValueError):
        return False


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like(ours: dict, received: dict) -> dict:
    """received's local tensors as DTensors shaped like ours (the same layout in every group)."""
    wrap = lambda key, value: DTensor(received[key], value._spec, requires_grad=False)
    return {key: wrap(key, v) if isinstance(v, DTensor) else received[key] for key, v in ours.items()}


def healing_state(model_parts, optimizers, dataloader, train_state) -> dict:
    """Each rank's own shards of the model and optimizer (every group has the same layout), and the
    step, tokens seen, RNG and data cursor."""
    return {
        "model": {k: local(v) for k, v in model_state(model_parts).items()},
        "optimizer": {k: local(v) for k, v in optimizer_state(model_parts, optimizers.parts).items()},
        "train": train_state.to_dict(),
        "dataloader": dataloader.state_dict(),
    }


def load_healing_state(received: dict, model_parts, optimizers, dataloader, train_state) -> None:
    load_model_state(model_parts, like(model_state(model_parts), received["model"]))
    ours = optimizer_state(model_parts, optimizers.parts)
    load_optimizer_state(model_parts, optimizers.parts, like(ours, received["optimizer"]))
    train_state.load_dict(received["train"])
    dataloader.load_state_dict(received["dataloader"])


class FaultTolerance:
    def __init__(self, config: Config, device: torch.device, dp_replicate: int, checkpoint_interval: int = 0):
        """checkpoint_interval: the checkpoint config's interval, 0 when checkpointing is off."""
        self.enabled = config.enable
        self.groups = config.group_size if config.enable else 1
        self.replica_id = config.replica_id if config.enable else 0
        self.semi_sync = config.enable and config.semi_sync_method != "none"
        self.sync_steps = config.sync_steps
        self.manager = self.local_sgd = None
        self.device = device
        self.healed = False  # set by a peer's state arriving in a quorum
        self.step_failed = False  # set by commit(), said after the next quorum
        if not self.enabled:
            return
        if self.semi_sync and checkpoint_interval % self.sync_steps:
            raise UserError(
                f"checkpoint.interval ({checkpoint_interval}) must be a multiple of "
                f"fault_tolerance.sync_steps ({self.sync_steps}) with semi_sync_method "
                f"{config.semi_sync_method}: checkpoints are saved right after the groups average their "
                "parameters"
            )
        if dp_replicate != 1:
            raise UserError(
                "fault_tolerance replaces HSDP's replicas: set parallelism.data_parallel_replicate_degree "
                "= 1 and fault_tolerance.group_size to the number of replica groups"
            )
        quiet_torchft_logs()
        try:
            import torchft
        except ImportError:
            raise UserError("fault_tolerance.enable needs torchft (pip install torchft)") from None
        lighthouse = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise UserError("fault_tolerance needs the lighthouse's address: fault_tolerance.lighthouse or "
                            "$TORCHFT_LIGHTHOUSE (scripts/fault_tolerance_local.sh starts one)")  # fmt: skip
        if "MASTER_ADDR" not in os.environ:
            raise UserError("fault_tolerance needs torchrun (each replica group is a torchrun job)")
        self.lighthouse, self.timeout_seconds = lighthouse, config.timeout_seconds
        timeout = timedelta(seconds=config.timeout_seconds)
        nccl = config.backend == "nccl" or (config.backend == "auto" and device.type == "cuda")
        self.group = noting_members(torchft.ProcessGroupNCCL if nccl else torchft.ProcessGroupGloo)(
            timeout=timeout
        )
        self.loss_device = device if nccl else torch.device("cpu")
        try:
            self.manager = torchft.Manager(
                pg=self.group,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=config.min_replica_size,
                use_async_quorum=False,  # a group that is behind heals in step(), before it reads data
                replica_id=f"replica_{config.replica_id}",
                lighthouse_addr=lighthouse,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                # A quorum request that finds no lighthouse is sent again about every second until
                # the quorum times out: a lighthouse started again meanwhile lets the groups go on.
                quorum_retries=math.ceil(config.timeout_seconds),
                init_sync=False,  # every group starts from the same seed or checkpoint
            )
        except RuntimeError as error:  # torchft: "failed to connect to <lighthouse> within timeout ..."
            if lighthouse not in str(error):
                raise
            raise self._no_quorum() from None

    def _no_quorum(self) -> NoQuorum:
        waited = f"fault_tolerance.timeout_seconds = {self.timeout_seconds:g} s"
        if reachable(self.lighthouse):
            return NoQuorum(
                f"replica group {self.replica_id} found no quorum of replica groups within {waited}, "
                f"though the torchft lighthouse at {self.lighthouse} answers (fewer groups up than its "
                "--min_replicas?)"
            )
        return NoQuorum(
            f"the torchft lighthouse at {self.lighthouse} is unreachable: replica group {self.replica_id} "
            f"waited {waited} for it and stops. Start the lighthouse again at that address, then this "
            "group: it continues from a live group's state or the latest checkpoint "
            "(scripts/fault_tolerance_local.sh restarts both)"
        )

    @contextlib.contextmanager
    def _quorum(self, after_failed_step: bool = False) -> Iterator[None]:
        """Around the forming of a quorum: one that never forms stops the group (NoQuorum, one
        line). After it one warning names the groups it lost (torchft's traceback of the collective
        they broke is dropped) and says whether the step before was not committed."""
        before = self.group.replica_groups
        try:
            yield
        except TimeoutError:
            raise self._no_quorum() from None
        lost = [group for group in before if group not in self.group.replica_groups]
        rerun = "not committed, it runs again"
        if distributed.rank() != 0 or not (lost or after_failed_step):
            return
        if not lost:
            logger.warning(f"a replica group failed during the last step: {rerun}")
            return
        during = f" during the last step ({rerun})" if after_failed_step else ""
        if len(lost) == 1:
            logger.warning(f"replica group {lost[0]} was lost{during}: the other groups go on without it")
        else:
            names = ", ".join(map(str, lost))
            logger.warning(f"replica groups {names} were lost{during}: the others go on without them")

    # ---- data and reductions ---------------------------------------------------------------
    def data_parallel(self, degree: int, rank: int) -> tuple[int, int]:
        """This rank's place among the data-parallel ranks of all groups: (degree, rank)."""
        return degree * self.groups, self.replica_id * degree + rank

    def loss_batch(self, global_batch: int) -> int:
        """The samples whose tokens a group's loss is normalized by: the whole global batch when the
        groups sum gradients, the group's own share when it trains alone between syncs."""
        return global_batch // self.groups if self.semi_sync else global_batch

    def _sum_in_place(self, tensor: torch.Tensor) -> None:
        """The sum of every group's tensor: the mean of the live groups' x group_size."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.AVG).wait()
        tensor.mul_(self.groups)

    def sum_over_groups(self, losses: torch.Tensor) -> torch.Tensor:
        """A group's share of losses (normalized by the whole global batch) -> the global losses."""
        if not self.enabled or self.semi_sync:  # semi-sync: the group's own losses
            return losses
        dtype = torch.float64 if self.loss_device.type == "cpu" else None
        losses = losses.detach().to(self.loss_device, dtype)
        self._sum_in_place(losses)
        return losses

    def combine_groups(self, model_parts: list[nn.Module], optimizers) -> None:
        """How the groups' training adds up: every FSDP unit's reduced gradient shards summed over
        the groups at each step (FSDP's all-reduce hook runs after its reduce-scatter, where HSDP
        would all-reduce), or with local_sgd the parameters averaged every sync_steps steps."""
        if not self.enabled:
            return
        from torch.distributed.fsdp import FSDPModule

        if any(moe_layers(part) for part in model_parts):
            raise UserError(
                "fault_tolerance with Mixture-of-Experts layers is not supported yet (each group's "
                "expert-load counts would move its expert biases apart)"
            )
        if self.semi_sync:
            from torchft.local_sgd import LocalSGD

            if len(model_parts) != 1:
                raise UserError(
                    "fault_tolerance.semi_sync_method local_sgd needs one model part per rank (not a "
                    "pipeline schedule with several stages per rank)"
                )
            # Synced by sync() at step numbers (not by its optimizer hooks, which count only
            # the updates a non-finite step did not skip), so every group syncs at the same steps.
            self.local_sgd = LocalSGD(self.manager, model_parts[0], optimizers.parts[0], self.sync_steps)
            return
        for part in model_parts:
            for unit in part.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_all_reduce_hook(self._sum_in_place)

    # ---- the state a group heals from ------------------------------------------------------
    def register_state(self, model_parts, optimizers, dataloader, train_state, before_load) -> None:
        """What a peer sends a group that is behind (healing_state), loaded by load_healing_state
        after before_load() (the checkpointer's: a save's host copies may still read the state)."""
        if not self.enabled:
            return

        def load(received: dict) -> None:
            before_load()
            load_healing_state(received, model_parts, optimizers, dataloader, train_state)
            self.healed = True
            logger.info(f"healed from a live replica group: continuing after step {train_state.step}")

        save = lambda: healing_state(model_parts, optimizers, dataloader, train_state)
        self.manager.register_state_dict_fn("train", load, save)

    # ---- the step protocol (train.py: `with fault_tolerance.step(...)` around the loop's body) ----
    @contextlib.contextmanager
    def step(self, on_new_state: Callable[[], None]) -> Iterator[None]:
        """One step of the loop among the replica groups: the quorum of live groups first (a group
        that is behind copies a live peer's state here, then on_new_state() is called); a step that
        commit() or sync() abandons ends here. Disabled: the body runs as it is."""
        if self.enabled and not self.semi_sync:  # semi-sync: the quorum is at the next sync
            self.healed = False
            with self._quorum(after_failed_step=self.step_failed):
                self.manager.start_quorum()
            self.step_failed = False
            if self.healed:
                on_new_state()
        try:
            yield
        except StepAbandoned:
            pass

    def commit(self, optimizers) -> None:
        """Before the update: every group of the quorum finished this step, or none updates (the
        gradients are dropped and the step abandoned)."""
        if not self.enabled or self.semi_sync or self.manager.should_commit():
            return
        self.step_failed = True  # said at the next quorum, with the group lost if one was
        optimizers.zero_grad()
        raise StepAbandoned

    def sync(self, step: int, last_step: int, on_new_state: Callable[[], None]) -> None:
        """local_sgd, after every sync_steps-th step and the last: the quorum of live groups, then
        their parameters averaged (kept only if no group failed meanwhile). A group that was behind
        heals first: on_new_state() is called and the step abandoned."""
        if self.local_sgd is None or (step % self.sync_steps and step != last_step):
            return
        self.healed = False
        with self._quorum():  # (and the averaging: torchft's LocalSGD does both)
            self.local_sgd.sync()
        if self.manager.errored() is not None and distributed.rank() == 0:
            logger.warning("a replica group failed during this sync: the parameters were not averaged")
        if self.healed:
            on_new_state()
            raise StepAbandoned

    def tokens_used(self, tokens_per_step: int) -> int:
        """The tokens of the samples this step's update used: the live groups' shares."""
        return tokens_per_step * self.participants() // self.groups

    def participants(self) -> int:
        """Groups whose samples this step's update used."""
        return self.manager.num_participants() if self.enabled and not self.semi_sync else 1

    def writes_checkpoints(self) -> bool:
        """One group saves: the first live one (checkpoints are shared by all groups)."""
        return not self.enabled or self.manager.participating_rank() == 0

    def close(self) -> None:
        if self.enabled:
            self.manager.shutdown(wait=False)
