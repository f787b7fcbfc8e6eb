"""The guard against non-finite steps: a NaN/Inf loss or gradient stops (or skips) the step before
the optimizer update can spread it into the weights.

The check reads the global gradient norm on the host, one synchronization per step; with the
guard off there is none. A non-finite loss always makes the gradient norm non-finite too.
"""

import logging

import torch

logger = logging.getLogger(__name__)


class NonFiniteError(Exception):
    """Training cannot go on: train.py prints it as one `error:` line and exits 1."""


class NonFiniteGuard:
    def __init__(self, policy: str, max_skipped_steps: int):
        self.policy = policy  # "stop", "skip" or "off"
        self.max_skipped_steps = max_skipped_steps
        self.skipped = 0

    def allows_update(self, grad_norm: torch.Tensor, step: int) -> bool:
        """False when this step's update must be skipped; raises when training must stop."""
        if self.policy == "off" or torch.isfinite(grad_norm).item():
            return True
        what = f"step {step}: the loss or the gradients are not finite (gradient norm {grad_norm.item()})"
        if self.policy == "stop":
            raise NonFiniteError(f"{what}; stopped before the optimizer update (training.nonfinite_policy)")
        self.skipped += 1
        if self.skipped > self.max_skipped_steps:
            raise NonFiniteError(
                f"{what}, {self.skipped} steps skipped, more than training.max_skipped_steps"
            )
        logger.warning(f"{what}: update skipped ({self.skipped} of at most {self.max_skipped_steps})")
        return False
