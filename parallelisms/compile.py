"""torch.compile per transformer block (and the loss), and the check that nothing recompiles."""

import logging

import torch
from torch import nn

from configs import UserError
from configs.schema import JobConfig

logger = logging.getLogger(__name__)


def check_compile(config: JobConfig, tp_enabled: bool) -> None:
    if config.compile.enable and tp_enabled and config.activation_checkpoint.mode != "none":
        # torch 2.13: the compiled checkpoint region saves the tensor-parallel DeviceMesh for
        # backward and AOT autograd rejects it ("expected all tensors_saved_with_vc_check to be
        # Tensors"). Compiling inside the checkpoint instead would defeat selective checkpointing.
        raise UserError(
            "compile with activation checkpointing and tensor parallelism fails in torch's compiled "
            "checkpoint; turn off one of compile.enable, activation_checkpoint.mode or TP"
        )


def apply_compile(model: nn.Module, fullgraph: bool) -> None:
    """Compile every block of model.layers in place (module.compile keeps parameter names).

    Blocks are compiled one by one, not the whole model: FSDP's per-block hooks and pipeline
    splits stay outside the graphs, and identical blocks share one compiled graph.
    """
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph)


def compiled_frames() -> int:
    """Frames torch.compile has compiled so far in this process (recompilations included)."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


class RecompileWatch:
    """Everything is compiled in the first two steps (the second may differ in grad state); any
    compilation after that means shapes or guards changed, which makes steps slow: warn."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.baseline: int | None = None
        self.reported = 0

    def warmed_up(self) -> None:
        if self.enabled:
            self.baseline = compiled_frames()

    def recompiles(self) -> int:
        """Frames compiled since warm-up (warns when the number grows)."""
        if not self.enabled or self.baseline is None:
            return 0
        count = compiled_frames() - self.baseline
        if count > self.reported:
            logger.warning(
                f"torch.compile compiled {count} more frames after warm-up; steps are slow meanwhile"
            )
            self.reported = count
        return count
