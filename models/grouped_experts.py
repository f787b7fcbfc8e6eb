"""The routed experts of models/moe.py: stacked weights and their computation on tokens sorted by
expert (plain PyTorch), the piece that expert parallelism runs on the tokens it receives.

Two kinds (MoEArgs.expert_activation): GroupedExperts, SwiGLU without biases (Qwen3, DeepSeek), and
ClampedSwiGLUExperts, gpt-oss's (gate and up projections in one weight, biases, a clamped SwiGLU).
One grouped GEMM per projection (torch._grouped_mm) where torch runs it for the device and dtype;
elsewhere a loop over the experts, written as custom ops so that torch.compile (whole blocks,
fullgraph) sees one operation of known shape instead of the loop's data-dependent split.
"""

import torch
import torch.nn.functional as F
from torch import nn


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """The part of a weight this rank holds. A parallelism may hand the router and expert weights
    over as DTensors (replicated over tensor parallelism, models/moe_plans.py; sharded over experts
    by expert parallelism), whose local tensors the layer computes with; a plain tensor is itself.
    (Asked of the type: torch.compile, outside a checkpointed block, answered hasattr(weight,
    "to_local") False for a DTensor parameter, torch 2.13.)"""
    return weight.to_local() if hasattr(type(weight), "to_local") else weight


def grouped_mm_runs(tokens: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs on these operands, as measured (docs/moe.md): bf16 on CPU and
    CUDA (torch 2.11 on an H200), fp32 on CPU but not under torch.compile; rows 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or any(w.dtype != tokens.dtype for w in weights):
        return False
    widths = {tokens.shape[-1], *(w.shape[-1] for w in weights)}
    if any(width * tokens.element_size() % 16 for width in widths):
        return False
    device = tokens.device.type
    if tokens.dtype == torch.bfloat16:
        return device in ("cpu", "cuda")
    return tokens.dtype == torch.float32 and device == "cpu" and not torch.compiler.is_compiling()


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch._grouped_mm's backward fails on
    a zero-stride one (the gradient of y.sum())."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def expert_swiglu(
    tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """Each expert's w2(silu(x w1) * x w3) on its run of `tokens`, which are sorted by expert:
    tokens_per_expert[e] rows for expert e (zeros allowed), adding up to all rows (grouped GEMM
    leaves rows past the last run undefined). Weights stacked (experts, in, out).

    Grouped GEMMs where torch runs them for this device and dtype (grouped_mm_runs), else a loop
    over the experts (looped_expert_swiglu).
    """
    device = tokens.device.type
    if torch.is_autocast_enabled(device):  # autocast does not cover torch._grouped_mm: cast as it would
        dtype = torch.get_autocast_dtype(device)
        tokens, w1, w2, w3 = (t.to(dtype) for t in (tokens, w1, w2, w3))
    if grouped_mm_runs(tokens, w1, w2, w3):
        ends = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        hidden = F.silu(torch._grouped_mm(tokens, w1, offs=ends)) * torch._grouped_mm(tokens, w3, offs=ends)
        return _ContiguousGradient.apply(torch._grouped_mm(hidden, w2, offs=ends))
    return looped_expert_swiglu(tokens, tokens_per_expert, w1, w2, w3)


def _expert_loop(tokens, tokens_per_expert, w1, w2, w3) -> torch.Tensor:
    runs = torch.split(tokens, tokens_per_expert.tolist())  # reads the counts on the host
    return torch.cat([(F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e] for e, x in enumerate(runs)])


# The loop's backward recomputes each expert's two input projections, then writes out the gradients.
@torch.library.custom_op("moe::looped_expert_swiglu", mutates_args=())
def looped_expert_swiglu(
    tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """expert_swiglu one expert at a time: where torch._grouped_mm does not run."""
    return _expert_loop(tokens, tokens_per_expert, w1, w2, w3)


@looped_expert_swiglu.register_fake
def _(tokens, tokens_per_expert, w1, w2, w3):
    return tokens.new_empty(tokens.shape[0], w2.shape[-1])


@torch.library.custom_op("moe::looped_expert_swiglu_backward", mutates_args=())
def _looped_expert_swiglu_backward(
    grad: torch.Tensor,
    tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of tokens, w1, w2, w3, written out (autograd does not record inside a custom op)."""
    d_w1, d_w2, d_w3 = torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(w3)
    d_tokens = []
    counts = tokens_per_expert.tolist()
    for e, (x, g) in enumerate(zip(torch.split(tokens, counts), torch.split(grad, counts))):
        a, b = x @ w1[e], x @ w3[e]
        gate = torch.sigmoid(a)
        silu = a * gate
        d_hidden = g @ w2[e].T
        d_a = d_hidden * b * gate * (1 + a * (1 - gate))  # silu'(a) = sigmoid(a) (1 + a (1 - sigmoid(a)))
        d_b = d_hidden * silu
        d_w2[e], d_w1[e], d_w3[e] = (silu * b).T @ g, x.T @ d_a, x.T @ d_b
        d_tokens.append(d_a @ w1[e].T + d_b @ w3[e].T)
    return torch.cat(d_tokens), d_w1, d_w2, d_w3


@_looped_expert_swiglu_backward.register_fake
def _(grad, tokens, tokens_per_expert, w1, w2, w3):
    return tuple(torch.empty_like(t) for t in (tokens, w1, w2, w3))


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _looped_backward(ctx, grad):
    tokens, tokens_per_expert, w1, w2, w3 = ctx.saved_tensors
    d_tokens, d_w1, d_w2, d_w3 = _looped_expert_swiglu_backward(grad, tokens, tokens_per_expert, w1, w2, w3)
    return d_tokens, None, d_w1, d_w2, d_w3


looped_expert_swiglu.register_autograd(_looped_backward, setup_context=_save_inputs)


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w1, w3 (experts, dim, hidden), w2 (experts,
    hidden, dim). Expert parallelism shards dim 0 and runs forward on the tokens it receives."""

    # Each expert's matrix is stored (in, out), transposed from nn.Linear's (out, in): what
    # matrix-aware optimizers (Muon's lr adjustment, training/muon.py) read as rows and columns.
    matrices_in_out = True

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """tokens sorted by expert, tokens_per_expert: one count per expert this module holds."""
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        return expert_swiglu(tokens, tokens_per_expert, w1, w2, w3)

    def init_weights(self, out_std: float) -> None:
        # Each stacked tensor is drawn whole, so an expert-parallel shard is a slice of the same values.
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=out_std)


# ---- gpt-oss's experts ---------------------------------------------------------------------------


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of the gate and up projections, interleaved in gate_up's last dim (gate
    at even, up at odd columns): gate clamped above at limit, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def expert_clamped_swiglu(
    tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Each expert's down(clamped_swiglu(x gate_up + gate_up_bias)) + down_bias on its run of
    `tokens` (sorted by expert, as expert_swiglu). gate_up (experts, in, 2 x hidden), down (experts,
    hidden, out), biases (experts, width). Grouped GEMMs where they run, else a loop."""
    device = tokens.device.type
    weights = (gate_up, gate_up_bias, down, down_bias)
    if torch.is_autocast_enabled(device):  # autocast does not cover torch._grouped_mm: cast as it would
        dtype = torch.get_autocast_dtype(device)
        tokens, weights = tokens.to(dtype), tuple(w.to(dtype) for w in weights)
    gate_up, gate_up_bias, down, down_bias = weights
    if not grouped_mm_runs(tokens, gate_up, down, down.mT):  # down.mT: the hidden width, aligned too
        return looped_clamped_swiglu(tokens, tokens_per_expert, *weights, alpha, limit)
    ends = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    rows = tokens.shape[0]  # each row's bias: its expert's, repeated over the expert's run of rows
    bias_of = lambda bias: bias.repeat_interleave(tokens_per_expert, dim=0, output_size=rows)
    projected = torch._grouped_mm(tokens, gate_up, offs=ends) + bias_of(gate_up_bias)
    hidden = clamped_swiglu(projected, alpha, limit)
    return _ContiguousGradient.apply(torch._grouped_mm(hidden, down, offs=ends) + bias_of(down_bias))


@torch.library.custom_op("moe::looped_clamped_swiglu", mutates_args=())
def looped_clamped_swiglu(
    tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """expert_clamped_swiglu one expert at a time: where torch._grouped_mm does not run."""
    runs = torch.split(tokens, tokens_per_expert.tolist())  # reads the counts on the host
    return torch.cat([
        clamped_swiglu(x @ gate_up[e] + gate_up_bias[e], alpha, limit) @ down[e] + down_bias[e]
        for e, x in enumerate(runs)
    ])  # fmt: skip


@looped_clamped_swiglu.register_fake
def _(tokens, tokens_per_expert, gate_up, gate_up_bias, down, down_bias, alpha, limit):
    return tokens.new_empty(tokens.shape[0], down.shape[-1])


@torch.library.custom_op("moe::looped_clamped_swiglu_backward", mutates_args=())
def _looped_clamped_swiglu_backward(
    grad: torch.Tensor,
    tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of tokens, gate_up, gate_up_bias, down, down_bias, written out per expert (autograd
    does not record inside a custom op); clamp passes gradient where its input is within bounds."""
    d_gate_up, d_gate_up_bias = torch.zeros_like(gate_up), torch.zeros_like(gate_up_bias)
    d_down, d_down_bias = torch.zeros_like(down), torch.zeros_like(down_bias)
    d_tokens = []
    counts = tokens_per_expert.tolist()
    for e, (x, g) in enumerate(zip(torch.split(tokens, counts), torch.split(grad, counts))):
        projected = x @ gate_up[e] + gate_up_bias[e]
        gate_in, up_in = projected[:, ::2], projected[:, 1::2]
        gate, up = gate_in.clamp(max=limit), up_in.clamp(min=-limit, max=limit)
        sigmoid = torch.sigmoid(alpha * gate)
        glu = gate * sigmoid
        d_down[e], d_down_bias[e] = (glu * (up + 1)).T @ g, g.sum(dim=0)
        d_hidden = g @ down[e].T
        d_gate = d_hidden * (up + 1) * (sigmoid + alpha * glu * (1 - sigmoid)) * (gate_in <= limit)
        d_up = d_hidden * glu * ((up_in >= -limit) & (up_in <= limit))
        d_projected = torch.stack([d_gate, d_up], dim=-1).flatten(-2)  # interleaved again
        d_gate_up[e], d_gate_up_bias[e] = x.T @ d_projected, d_projected.sum(dim=0)
        d_tokens.append(d_projected @ gate_up[e].T)
    return torch.cat(d_tokens), d_gate_up, d_gate_up_bias, d_down, d_down_bias


@_looped_clamped_swiglu_backward.register_fake
def _(grad, tokens, tokens_per_expert, gate_up, gate_up_bias, down, down_bias, alpha, limit):
    return tuple(torch.empty_like(t) for t in (tokens, gate_up, gate_up_bias, down, down_bias))


def _save_clamped_inputs(ctx, inputs, output) -> None:
    *tensors, ctx.alpha, ctx.limit = inputs
    ctx.save_for_backward(*tensors)


def _looped_clamped_backward(ctx, grad):
    grads = _looped_clamped_swiglu_backward(grad, *ctx.saved_tensors, ctx.alpha, ctx.limit)
    d_tokens, d_gate_up, d_gate_up_bias, d_down, d_down_bias = grads
    return d_tokens, None, d_gate_up, d_gate_up_bias, d_down, d_down_bias, None, None


looped_clamped_swiglu.register_autograd(_looped_clamped_backward, setup_context=_save_clamped_inputs)


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's routed experts, stacked: gate_up (experts, dim, 2 x hidden), its columns the gate
    and up projections interleaved (gate 2i, up 2i + 1, the layout of gpt-oss's checkpoints), down
    (experts, hidden, dim), each with a bias per expert (experts, width). Expert parallelism shards
    dim 0 of all four and runs forward on the tokens it receives."""

    matrices_in_out = True  # as GroupedExperts

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.gate_up_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim))
        self.down = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.down_bias = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """tokens sorted by expert, tokens_per_expert: one count per expert this module holds."""
        weights = (local_tensor(w) for w in (self.gate_up, self.gate_up_bias, self.down, self.down_bias))
        return expert_clamped_swiglu(tokens, tokens_per_expert, *weights, self.alpha, self.limit)

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.gate_up, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.down, mean=0.0, std=out_std)
        nn.init.zeros_(self.gate_up_bias)
        nn.init.zeros_(self.down_bias)
