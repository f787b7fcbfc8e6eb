"""Mixture-of-Experts feed-forward layer (plain PyTorch, no distributed code), for any model family.

An `MoE` replaces a block's dense feed-forward:

    tokens --route----> top_k experts and their gate values, per token
           --dispatch-> each token copied top_k times, the copies sorted by expert (stable)
           --experts--> every expert's SwiGLU on its run of sorted copies (GroupedExperts)
           --combine--> each token's top_k outputs weighted by its gate values and summed
           (+ shared experts: a dense SwiGLU that every token goes through)

No token is ever dropped (no capacity limit). Expert parallelism will put an all-to-all between
dispatch and experts and another between experts and combine: GroupedExperts.forward(tokens sorted
by expert, tokens per expert) (models/grouped_experts.py) is what it runs on the tokens a rank
receives, and its weights are stacked (experts, in, out) so that a rank's experts are a slice of dim 0.

Load balancing (both optional, docs/moe.md):
- auxiliary-loss-free (DeepSeek-V3): `expert_bias` is added to the scores only to choose experts;
  the training loop sums `tokens_per_expert` over ranks and calls update_expert_bias() each step;
- a load-balance loss per sequence and layer, added to the objective through the gradient it sends
  back (AddAuxiliaryLoss), so the loss function, pipeline schedules and layouts stay unchanged.
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.grouped_experts import ClampedSwiGLUExperts, GroupedExperts, local_tensor

SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclass(frozen=True)
class MoEArgs:
    """A family's args dataclass has these fields under the same names (MoEArgs.of(args)), those
    without a default at least."""

    n_experts: int
    top_k: int
    """Routed experts per token."""
    expert_hidden_dim: int
    """Hidden width of each routed expert's SwiGLU."""
    score_func: str = "softmax"
    """Router logits to scores: "softmax" over the experts (Qwen3) or "sigmoid" per expert (DeepSeek-V3)."""
    renormalize: bool = True
    """Gate values are the chosen experts' scores divided by their sum (Hugging Face's norm_topk_prob)."""
    route_scale: float = 1.0
    """Multiplies the gate values (DeepSeek-V3: 2.5)."""
    n_expert_groups: int = 1
    """Experts form this many equal groups, and a token chooses only among the experts of its
    topk_groups best groups (DeepSeek-V3's node-limited routing); 1: no groups."""
    topk_groups: int = 1
    group_score: str = "top2_sum"
    """How groups are ranked: by the sum of their two best experts' (biased) scores ("top2_sum",
    DeepSeek-V3) or by their best expert's score ("max", DeepSeek-V2's group_limited_greedy)."""
    shared_hidden_dim: int = 0
    """Hidden width of the shared experts, a dense SwiGLU added for every token; 0: none."""
    bias_update_rate: float = 0.0
    """Step of the auxiliary-loss-free balancing (DeepSeek-V3: 1e-3), which the training loop passes
    to update_expert_bias(); 0: the expert bias stays zero."""
    aux_loss_coeff: float = 0.0
    """Weight in the objective of every layer's per-sequence load-balance loss; 0: none."""
    router_bias: bool = False
    """The router's projection has a bias (gpt-oss)."""
    expert_activation: str = "swiglu"
    """The routed experts: "swiglu", w2(silu(x w1) * x w3) without biases (Qwen3, DeepSeek), or
    "clamped_swiglu", gpt-oss's: projections with biases, gate clamped above at swiglu_limit, up to
    +-swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1) (models/grouped_experts.py)."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        """Shapes that cannot route (ValueError, reported as the run's error line)."""
        if min(self.n_experts, self.top_k, self.expert_hidden_dim) < 1:
            raise ValueError("n_experts, top_k and expert_hidden_dim must be >= 1")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k {self.top_k} is more than n_experts {self.n_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func '{self.score_func}' is not one of {', '.join(SCORE_FUNCS)}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score '{self.group_score}' is not one of {', '.join(GROUP_SCORES)}")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"expert_activation '{self.expert_activation}' is not one of {', '.join(EXPERT_ACTIVATIONS)}"
            )
        if self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit {self.swiglu_limit} must be > 0")
        if self.n_expert_groups < 1 or self.n_experts % self.n_expert_groups:
            raise ValueError(
                f"n_experts {self.n_experts} must be divisible by n_expert_groups {self.n_expert_groups}"
            )
        if not 1 <= self.topk_groups <= self.n_expert_groups:
            raise ValueError(
                f"topk_groups {self.topk_groups} must be between 1 and n_expert_groups {self.n_expert_groups}"
            )
        reachable = self.topk_groups * (self.n_experts // self.n_expert_groups)
        if self.top_k > reachable:
            raise ValueError(
                f"top_k {self.top_k} is more than the {reachable} experts of topk_groups {self.topk_groups}"
            )
        if (
            self.route_scale <= 0
            or min(self.shared_hidden_dim, self.bias_update_rate, self.aux_loss_coeff) < 0
        ):
            raise ValueError(
                "route_scale must be > 0; shared_hidden_dim, bias_update_rate and aux_loss_coeff >= 0"
            )

    @classmethod
    def of(cls, args) -> "MoEArgs":
        """The MoE fields of a family's flat args dataclass (flat, so that model.args overrides them);
        a field the family does not define keeps its default here."""
        names = (field.name for field in dataclasses.fields(cls))
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})


MOE_OPTIONS = tuple(field.name for field in dataclasses.fields(MoEArgs))


# ---- Routing -------------------------------------------------------------------------------------


def expert_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Router logits (tokens, n_experts) -> scores in float32, whatever the compute dtype."""
    logits = logits.float()
    return logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, equal values in index order: torch.topk
    leaves the order of ties open, and every device and layout must route alike."""
    return values.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def limit_to_best_groups(
    choice: torch.Tensor, n_groups: int, topk_groups: int, group_score: str = "top2_sum"
) -> torch.Tensor:
    """choice (tokens, n_experts) with -inf for the experts outside each token's topk_groups best
    groups; a group's score is the sum of its two best experts' (DeepSeek-V3) or its best one's."""
    tokens, n_experts = choice.shape
    grouped = choice.view(tokens, n_groups, n_experts // n_groups)
    if group_score == "max":
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # values: ties harmless
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(-1, top_indices(group_scores, topk_groups), True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, n_experts)


def choose_experts(
    scores: torch.Tensor, expert_bias: torch.Tensor, args: MoEArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, gates), both (tokens, top_k): the top_k experts by score + bias (within the best
    groups), and their gate values from the scores alone: the bias steers the choice, never the
    output's weights."""
    choice = scores + expert_bias
    if args.n_expert_groups > 1:
        choice = limit_to_best_groups(choice, args.n_expert_groups, args.topk_groups, args.group_score)
    experts = top_indices(choice, args.top_k)
    gates = scores.gather(-1, experts)
    if args.renormalize:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, gates * args.route_scale


# ---- Shared experts ------------------------------------------------------------------------------


class SharedExperts(nn.Module):
    """Dense SwiGLU that every token goes through beside the routed experts: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_std)


# ---- Load balancing ------------------------------------------------------------------------------


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per sequence, n_experts x sum_e f_e P_e (1 when perfectly balanced, up to n_experts):
    f_e the share of the sequence's routed copies sent to expert e, P_e the mean probability the
    router gives e (scores normalized per token). scores (batch, seq, E), experts (batch, seq, k)
    -> (batch,); differentiable through the scores only."""
    batch, _, n_experts = scores.shape
    probs = scores if score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    chosen = experts.reshape(batch, -1)
    counts = torch.zeros(batch, n_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    return n_experts * (counts / chosen.shape[1] * probs.mean(dim=1)).sum(dim=-1)


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns `output` unchanged; its backward also sends gradient 1 into `aux_loss`, so the
    parameters receive d(loss + aux_loss) without the loss function knowing of aux_loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux_loss.dtype
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


def _recomputing() -> bool:
    """Inside a backward pass: activation checkpointing re-running a forward it has already counted
    (compiled graphs recompute inside the graph, without re-running this Python)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


# ---- The layer -----------------------------------------------------------------------------------


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of a dense feed-forward; x (batch, seq, dim).

    Buffers: `expert_bias` (n_experts,) float32, saved in checkpoints; `tokens_per_expert`
    (n_experts,) int64, the routed copies of training forwards since the loop last reset it (not
    saved); `aux_loss`, the balance losses of the sequences of those forwards, summed (the loop
    divides by the step's sequences).
    """

    def __init__(self, dim: int, args: MoEArgs, out_init_std: float = 0.02):
        super().__init__()
        self.dim, self.args, self.out_init_std = dim, args, out_init_std
        self.router = nn.Linear(dim, args.n_experts, bias=args.router_bias)
        if args.expert_activation == "clamped_swiglu":
            self.experts = ClampedSwiGLUExperts(
                args.n_experts, dim, args.expert_hidden_dim, args.swiglu_alpha, args.swiglu_limit
            )
        else:
            self.experts = GroupedExperts(args.n_experts, dim, args.expert_hidden_dim)
        self.shared_experts = SharedExperts(dim, args.shared_hidden_dim) if args.shared_hidden_dim else None
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(args.n_experts, dtype=torch.int64), persistent=False
        )
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.sequences_per_step: int | None = None
        """Set by set_sequences_per_step(); None: this micro-batch is the whole step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, experts, gates = self.route(tokens)
        routed, tokens_per_expert, order = self.dispatch(tokens, experts)
        out = self.combine(self.experts(routed, tokens_per_expert), gates, order)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(batch, seq, dim)
        if not (self.training and torch.is_grad_enabled()):
            return out  # evaluation: neither counted nor balanced
        counted = not _recomputing()
        if counted:
            with torch.no_grad():
                self.tokens_per_expert.add_(tokens_per_expert)
        if self.args.aux_loss_coeff > 0:
            out = self.add_aux_loss(out, scores.view(batch, seq, -1), experts.view(batch, seq, -1), counted)
        return out

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (n, dim) -> float32 scores (n, n_experts), chosen experts and gate values (n, top_k)."""
        bias = local_tensor(self.router.bias) if self.router.bias is not None else None
        logits = F.linear(tokens, local_tensor(self.router.weight), bias)
        scores = expert_scores(logits, self.args.score_func)
        experts, gates = choose_experts(scores, self.expert_bias, self.args)
        return scores, experts, gates

    def dispatch(
        self, tokens: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(routed, tokens_per_expert, order): the top_k copies of the tokens sorted by expert (a
        stable sort: copies keep token order within an expert), the count per expert, and the
        permutation of the copies (copy t * top_k + j is token t's j-th choice) that combine undoes."""
        choices = experts.flatten()
        order = choices.argsort(stable=True)
        tokens_per_expert = torch.zeros(self.args.n_experts, dtype=torch.int64, device=choices.device)
        tokens_per_expert.scatter_add_(0, choices, torch.ones_like(choices))
        return tokens[order // self.args.top_k], tokens_per_expert, order

    def combine(self, expert_out: torch.Tensor, gates: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """(n, dim): each token's top_k expert outputs (expert_out in dispatch's order) weighted by its
        gate values and summed; a gather and a batched product, no atomics, so deterministic."""
        copies = expert_out[order.argsort()].view(gates.shape[0], self.args.top_k, -1)
        return torch.bmm(gates.unsqueeze(1).to(copies.dtype), copies).squeeze(1)

    def add_aux_loss(
        self, out: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor, record: bool
    ) -> torch.Tensor:
        """out, whose backward adds aux_loss_coeff x this micro-batch's share of the step's mean
        per-sequence balance loss to the objective; adds the sequences' losses to `aux_loss`."""
        per_sequence = sequence_balance_loss(scores, experts, self.args.score_func)
        if record:
            self.aux_loss.add_(per_sequence.detach().sum())
        sequences = self.sequences_per_step or out.shape[0]
        return AddAuxiliaryLoss.apply(out, per_sequence.sum() * (self.args.aux_loss_coeff / sequences))

    def active_parameters(self) -> int:
        """Parameters one token goes through (router, top_k routed experts, shared experts): FLOPs."""
        shared = sum(p.numel() for p in self.shared_experts.parameters()) if self.shared_experts else 0
        per_expert = sum(p.numel() for p in self.experts.parameters()) // self.args.n_experts
        return sum(p.numel() for p in self.router.parameters()) + self.args.top_k * per_expert + shared

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.router.weight, mean=0.0, std=0.02)
        if self.router.bias is not None:
            nn.init.zeros_(self.router.bias)
        self.experts.init_weights(self.out_init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(self.out_init_std)

    def init_buffers(self) -> None:
        """Zero bias, counts and loss (after materialization; a checkpoint then loads the bias)."""
        for buffer in (self.expert_bias, self.tokens_per_expert, self.aux_loss):
            buffer.zero_()


# ---- For the training loop -----------------------------------------------------------------------


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every MoE layer of a model or pipeline stage, by module name ("layers.3.moe"; wrappers such as
    activation checkpointing add their prefixes: parallelisms/wrapper_names.original_name strips them)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MoE)}


def set_sequences_per_step(model: nn.Module, sequences: int) -> None:
    """How many sequences one optimizer step's micro-batches hold on all ranks together (global
    batch x context-parallel degree: a rank's chunks of a sequence count as one), so that the balance
    loss enters the objective as its mean over the step's sequences on any layout."""
    for moe in moe_layers(model).values():
        moe.sequences_per_step = sequences


@torch.no_grad()
def update_expert_bias(moe: MoE, counts: torch.Tensor, coeff: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing step: bias += coeff x sign(mean - count), so that
    under-used experts get chosen more, then the bias is made zero-mean again. counts: the step's
    tokens_per_expert summed over the data-parallel and context-parallel ranks (not over tensor-
    parallel ones, which route the same tokens)."""
    counts = counts.to(moe.expert_bias.device, torch.float32)
    moe.expert_bias.add_(coeff * torch.sign(counts.mean() - counts))
    moe.expert_bias.sub_(moe.expert_bias.mean())


def load_statistics(counts: torch.Tensor) -> dict[str, float]:
    """A layer's expert load from its counts (tokens_per_expert, reduced): max and min over the
    mean (1 and 1 when balanced) and idle experts. Reads the counts on the host."""
    loads = counts.tolist()
    mean = sum(loads) / len(loads)
    if mean == 0:
        return {"max_load": 0.0, "min_load": 0.0, "idle_experts": len(loads)}
    return {"max_load": max(loads) / mean, "min_load": min(loads) / mean, "idle_experts": loads.count(0)}
