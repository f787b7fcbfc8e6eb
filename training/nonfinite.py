"""The guard against non-finite steps: a NaN/Inf loss or gradient never reaches the weights.

The check stays on the device, so it costs no host-device synchronization: each step's flag goes
to the optimizer (fused AdamW skips the whole update, moments and step count included, when its
`found_inf` is set; see training/optimizer.py). The host reads the guard's counters in check(),
which train.py calls where it reads the device anyway (logging) and before every save.

    stop  the first non-finite step and every later one skip their updates, and check() raises:
          the weights stay those from before that step
    skip  non-finite steps skip their updates; once more than max_skipped_steps were skipped,
          every later update is skipped too and check() raises
    off   no check

A non-finite loss always makes the gradient norm non-finite too, so the norm is what is checked.
"""

import logging

import torch

from training.host_reads import to_host

logger = logging.getLogger(__name__)


class NonFiniteError(Exception):
    """Training cannot go on: train.py prints it as one `error:` line and exits 1."""


class NonFiniteGuard:
    def __init__(self, policy: str, max_skipped_steps: int, device: torch.device):
        self.policy = policy  # "stop", "skip" or "off"
        self.max_skipped_steps = max_skipped_steps
        self.bad_steps = torch.zeros((), dtype=torch.int64, device=device)  # since the start
        self.first_bad_step = torch.zeros((), dtype=torch.int64, device=device)  # since the last check
        self.reported = 0

    def skip_update(self, grad_norm: torch.Tensor, step: int) -> torch.Tensor | None:
        """A device flag (float 0 or 1) that skips this step's optimizer update; None when off."""
        if self.policy == "off":
            return None
        bad = ~torch.isfinite(grad_norm)
        self.bad_steps += bad
        first = (self.first_bad_step == 0) & bad
        self.first_bad_step = torch.where(first, step, self.first_bad_step)
        limit = 0 if self.policy == "stop" else self.max_skipped_steps
        return (bad | (self.bad_steps > limit)).float()

    def check(self) -> None:
        """Raise if training must stop, warn about skipped steps since the last check (reads the
        device: call it where the host synchronizes anyway)."""
        if self.policy == "off":
            return
        bad_steps, first = (int(value) for value in to_host(self.bad_steps, self.first_bad_step))
        if bad_steps == self.reported:
            return
        what = f"step {first}: the loss or the gradients are not finite"
        if self.policy == "stop":
            raise NonFiniteError(
                f"{what}; stopped, no update made from that step on (training.nonfinite_policy)"
            )
        if bad_steps > self.max_skipped_steps:
            raise NonFiniteError(
                f"{what}; {bad_steps} step{'s' * (bad_steps != 1)} skipped, more than "
                f"training.max_skipped_steps ({self.max_skipped_steps}); no update made since the limit "
                "was passed"
            )
        logger.warning(
            f"{what}: its update was skipped ({bad_steps - self.reported} skipped since the last report, "
            f"{bad_steps} of at most {self.max_skipped_steps} in all)"
        )
        self.reported = bad_steps
        self.first_bad_step.zero_()
