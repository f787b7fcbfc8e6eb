"""AdamW whose moments may be kept in bfloat16: half of AdamW's 8 bytes of state per parameter.

torch.optim.AdamW keeps its moments in the parameter's dtype (float32 here), so this is our own
implementation of its arithmetic: torch's foreach AdamW (torch 2.13, decoupled weight decay, no
amsgrad), computed in float32 on moments read from and rounded back to `state_dtype` (round to
nearest). With float32 moments it is torch's update; tests/test_muon.py compares both with torch's
arithmetic. Muon (training/muon.py) updates its AdamW parameters with `adamw_update_` below.

The state has torch's keys (step, exp_avg, exp_avg_sq), so checkpoints of either load into the
other (DCP converts the moments' dtype).
"""

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard of a (DTensor) parameter, gradient or state this rank holds; a plain tensor itself.
    Updates are elementwise on the shards, which share the parameter's layout."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """The shard of param's gradient that matches the shard of param this rank holds (a DTensor
    gradient may come laid out otherwise, e.g. replicated where the parameter is sharded)."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def adamw_state(param: torch.Tensor, state: dict, state_dtype: torch.dtype) -> dict:
    """A parameter's AdamW state, made on its first update as torch's foreach AdamW makes it."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, dtype=state_dtype)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=state_dtype)
    return state


@torch.no_grad()
def adamw_update_(group: dict, params: list[torch.Tensor], states: list[dict]) -> None:
    """One AdamW update of params (with gradients) of a parameter group: lr, betas, eps,
    weight_decay, as torch.optim.AdamW's groups hold them."""
    if not params:
        return
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    weights = [local(p) for p in params]
    grads = [local_grad(p) for p in params]
    exp_avgs = [local(s["exp_avg"]) for s in states]
    exp_avg_sqs = [local(s["exp_avg_sq"]) for s in states]
    low_precision = exp_avgs[0].dtype != weights[0].dtype
    if low_precision:  # computed in the weights' dtype, rounded back below
        stored = exp_avgs + exp_avg_sqs
        exp_avgs = [m.to(weights[0].dtype) for m in exp_avgs]
        exp_avg_sqs = [v.to(weights[0].dtype) for v in exp_avg_sqs]
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
    if weight_decay != 0:
        torch._foreach_mul_(weights, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_sizes = [-lr / (1 - beta1 ** step.item()) for step in steps]
    bias_correction2_sqrt = [(1 - beta2 ** step.item()) ** 0.5 for step in steps]
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denominators, bias_correction2_sqrt)
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(weights, exp_avgs, denominators, step_sizes)
    if low_precision:
        torch._foreach_copy_(stored, exp_avgs + exp_avg_sqs)


class AdamW(torch.optim.Optimizer):
    """AdamW with moments in state_dtype (optimizer.state_dtype = "bfloat16"); groups as torch's."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, state_dtype: torch.dtype):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [adamw_state(p, self.state[p], self.state_dtype) for p in params]
            adamw_update_(group, params, states)
