"""Muon: momentum orthogonalized by Newton-Schulz iterations, for the matrices of the blocks, and
AdamW for every other parameter (embeddings, output, norms, router gates), in one optimizer.

Per matrix W with gradient G (torch.optim.Muon's arithmetic, torch 2.13):

    B = mu B + (1 - mu) G                    momentum (B.lerp_(G, 1 - mu))
    U = (1 - mu) G + mu B  (Nesterov), else B
    O = NewtonSchulz(U)                      ~ the nearest semi-orthogonal matrix (U V^T of U's SVD)
    W = W (1 - lr wd) - lr x adjust(rows, cols) x O

adjust: "match_rms_adamw" 0.2 sqrt(max(rows, cols)) (Moonlight: updates of AdamW's RMS, so one
lr serves both), "original" sqrt(max(1, rows / cols)) (Keller Jordan's), "none" 1. Rows are the
output dimension. Stacked expert weights are orthogonalized expert by expert: modules that store
each matrix as (in, out), transposed from nn.Linear's (out, in), say so with a class attribute
`matrices_in_out = True` (models/grouped_experts.py); Newton-Schulz gives the transpose of the
transpose's result, so only the adjustment reads the orientation.

Distributed, exactly: Newton-Schulz needs whole matrices, which FSDP shards by rows, tensor
parallelism by rows or columns and expert parallelism by experts. The momentum is updated on the
shards (elementwise, as AdamW's moments); then the matrices of one shape and layout are stacked
and redistributed so that each rank of the mesh receives whole matrices, a share of them (one
all-to-all), orthogonalizes those, and sends them back as shards (one all-to-all). Each matrix is
gathered once and orthogonalized on one rank; the work divides over the mesh. docs/muon.md.
"""

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from training.adamw import adamw_state, adamw_update_, local, local_grad


def newton_schulz(
    update: torch.Tensor, steps: int, coefficients: tuple[float, float, float], dtype: torch.dtype,
    eps: float = 1e-7,
) -> torch.Tensor:  # fmt: skip
    """The orthogonalization of each matrix of update (..., rows, cols), in dtype: torch's quintic
    iteration (torch.optim.Muon), batched over leading dimensions."""
    a, b, c = coefficients
    x = update.to(dtype).reshape(-1, *update.shape[-2:])
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.mT
    x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(update.shape)


def lr_adjustment(rows: int, cols: int, adjust: str) -> float:
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def _shifted(placement):
    """The placement of a parameter's layout on a stack of such parameters (one dimension more)."""
    return Shard(placement.dim + 1) if isinstance(placement, Shard) else placement


def _relaid(shards: list[torch.Tensor], like: DTensor, source, target) -> list[torch.Tensor]:
    """The local shards of DTensors shaped as like, laid out as source, laid out as target."""
    mesh = like.device_mesh
    return [
        DTensor.from_local(s, mesh, source, shape=like.shape, stride=like.stride())
        .redistribute(mesh, target)
        .to_local()
        for s in shards
    ]


def orthogonalize(updates: list[torch.Tensor], like: torch.Tensor, ns: dict) -> list[torch.Tensor]:
    """Newton-Schulz of equally shaped and laid out matrices (each 2-D, or one stack of experts):
    the local shards of updates in, the local shards of the results out. `like` is one of their
    parameters, whose layout (DTensor mesh and placements) they share."""
    if not isinstance(like, DTensor):
        result = newton_schulz(torch.stack(updates) if like.ndim == 2 else updates[0], **ns)
        return list(result.unbind(0)) if like.ndim == 2 else [result]
    # FSDP's strided shard (over tensor parallelism's shard of the same dimension) is gathered
    # first, matrix by matrix: torch 2.13 cannot redistribute a stack of such shards.
    layout = [Replicate() if hasattr(p, "split_factor") else p for p in like.placements]
    if layout != list(like.placements):
        updates = _relaid(updates, like, like.placements, layout)
    mesh = like.device_mesh
    stacked = torch.stack(updates) if like.ndim == 2 else updates[0]
    placements = [_shifted(p) for p in layout] if like.ndim == 2 else layout
    shape = (len(updates), *like.shape) if like.ndim == 2 else like.shape
    stride = torch.empty(shape, device="meta").stride()
    sharded = DTensor.from_local(stacked, mesh, placements, shape=shape, stride=stride)
    owned = sharded.redistribute(mesh, [Shard(0)] * mesh.ndim)  # whole matrices, a share on each rank
    done = DTensor.from_local(
        newton_schulz(owned.to_local(), **ns), mesh, owned.placements, shape=shape, stride=stride
    )
    result = done.redistribute(mesh, placements).to_local()
    results = list(result.unbind(0)) if like.ndim == 2 else [result]
    if layout != list(like.placements):  # (a local slice: no communication)
        results = _relaid(results, like, layout, like.placements)
    return results


class Muon(torch.optim.Optimizer):
    """Muon for the groups whose "algorithm" is "muon" (lr, momentum, nesterov, weight_decay,
    adjust_lr, matrices_in_out), AdamW for those whose "algorithm" is "adamw" (lr, betas, eps,
    weight_decay). ns: Newton-Schulz steps, coefficients, dtype. Moments and momentum buffers in
    state_dtype."""

    def __init__(self, groups: list[dict], ns_steps: int, ns_coefficients: tuple[float, float, float],
                 ns_dtype: torch.dtype, state_dtype: torch.dtype):  # fmt: skip
        super().__init__(groups, {})
        self.ns = dict(steps=ns_steps, coefficients=tuple(ns_coefficients), dtype=ns_dtype)
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == "adamw":
                adamw_update_(
                    group, params, [adamw_state(p, self.state[p], self.state_dtype) for p in params]
                )
            else:
                self._muon_update(group, params)

    def _muon_update(self, group: dict, params: list[torch.Tensor]) -> None:
        momentum, nesterov = group["momentum"], group["nesterov"]
        updates = {}
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype)
            grad, stored = local_grad(p), local(state["momentum_buffer"])
            buffer = stored.to(grad.dtype)  # (a copy only with low-precision state)
            buffer.lerp_(grad, 1 - momentum)
            if buffer is not stored:
                stored.copy_(buffer)
            updates[p] = grad.lerp(buffer, momentum) if nesterov else buffer
        # Matrices of one shape and layout are orthogonalized together (and, distributed, spread
        # over the ranks); a stack of experts on its own.
        alike = defaultdict(list)
        for p in params:
            layout = (p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None
            alike[(tuple(p.shape), p.dtype, layout) if p.ndim == 2 else id(p)].append(p)
        for same in alike.values():
            for p, orthogonal in zip(same, orthogonalize([updates[p] for p in same], same[0], self.ns)):
                rows, cols = p.shape[-2:] if not group["matrices_in_out"] else p.shape[:-3:-1]
                weight = local(p)
                weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.add_(
                    orthogonal.to(weight.dtype),
                    alpha=-group["lr"] * lr_adjustment(rows, cols, group["adjust_lr"]),
                )
