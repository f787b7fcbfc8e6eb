"""torch.compile per transformer block (and the loss), and the check that nothing recompiles."""

import contextlib
import logging

import torch
from torch import nn
from torch.torch_version import TorchVersion

from configs import UserError
from configs.schema import JobConfig

logger = logging.getLogger(__name__)


# torch 2.11-2.13: a compiled checkpoint region under tensor parallelism saves the TP DeviceMesh
# for backward and AOT autograd rejects it ("expected all tensors_saved_with_vc_check to be
# Tensors"); torch 2.14 compiles it (checked on CPU: tensor parallel 2, compile, full and by-op
# checkpointing, losses equal to eager).
COMPILED_CHECKPOINT_FAILS_WITH_TP = TorchVersion(torch.__version__) < "2.14"


def compile_inside_checkpointing(config: JobConfig, tp_enabled: bool) -> bool:
    """Compile each block first and checkpoint the compiled block, instead of compiling the
    checkpointed block, where torch cannot compile a checkpoint under tensor parallelism
    (COMPILED_CHECKPOINT_FAILS_WITH_TP). Checkpointing a whole compiled block recomputes the same
    activations (tested against eager); checkpointing by op cannot see the ops inside a compiled
    block, so that one combination is refused on those versions (check_compile)."""
    checkpointing = config.activation_checkpoint.mode != "none"
    return COMPILED_CHECKPOINT_FAILS_WITH_TP and config.compile.enable and tp_enabled and checkpointing


def check_compile(config: JobConfig, tp_enabled: bool) -> None:
    checkpointing = config.activation_checkpoint
    by_op = checkpointing.mode == "selective" and checkpointing.selective_ac_option == "op"
    if compile_inside_checkpointing(config, tp_enabled) and by_op:
        raise UserError(
            "compile with tensor parallelism and activation checkpointing by op (selective_ac_option = "
            f"'op') fails in torch {torch.__version__}'s compiled checkpoint (torch >= 2.14 runs it); "
            "use mode = 'full' or selective_ac_option = N"
        )


def apply_compile(model: nn.Module, fullgraph: bool, backend: str = "inductor") -> None:
    """Compile every block of model.layers in place (module.compile keeps parameter names).

    Blocks are compiled one by one, not the whole model: FSDP's per-block hooks and pipeline
    splits stay outside the graphs, and identical blocks share one compiled graph.
    """
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph, backend=backend)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled so far in this process (recompilations included). Counted
    by dynamo's "unique_graphs", which every compilation adds to; its "frames" counters leave out
    fullgraph compilations (torch 2.11-2.14), which is how blocks are compiled."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class RecompileWatch:
    """Counts graphs compiled after warm-up, which means shapes or guards changed and steps run
    slowly meanwhile: warns when it happens. Training compiles everything in its first two steps
    (the second may differ in grad state), evaluation in its first batch."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.calls: dict[str, int] = {}
        self.recompiled = 0

    @contextlib.contextmanager
    def watch(self, kind: str, warm_up_calls: int):
        """Around one call of `kind` ("train", "eval"); graphs it compiles after the first
        warm_up_calls calls of that kind count as recompilations."""
        before = compiled_graphs() if self.enabled else 0
        yield
        if not self.enabled:
            return
        self.calls[kind] = self.calls.get(kind, 0) + 1
        new = compiled_graphs() - before
        if new and self.calls[kind] > warm_up_calls:
            self.recompiled += new
            logger.warning(
                f"torch.compile compiled {new} more graphs in {kind} call {self.calls[kind]}; steps are "
                "slow meanwhile (shapes or guards changed)"
            )
