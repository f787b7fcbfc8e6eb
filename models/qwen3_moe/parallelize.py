"""How Qwen3-MoE is split by tensor parallelism: attention as in the standard decoder plan with
Qwen3's per-head QK-norms (models/qwen3/parallelize.py says how), the MoE layer as
models/moe_plans.py says: router and routed experts replicated over TP, shared experts split."""

from torch.distributed.tensor.parallel import SequenceParallel

from models.decoder_plans import block_plan, root_plan
from models.moe_plans import moe_plan
from models.spec import TensorParallelPlan


def tensor_parallel_plan(args, loss_parallel: bool) -> TensorParallelPlan:
    attention = {key: style for key, style in block_plan().items() if not key.startswith("feed_forward")}
    qk_norms = {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    return TensorParallelPlan(
        root=root_plan(loss_parallel), block=attention | qk_norms | moe_plan("moe", args.moe())
    )


def tensor_parallel_sizes(args) -> dict[str, int]:
    """Sizes the plan splits over tp, which the degree must divide (routed experts are not split)."""
    sizes = {
        "model n_heads": args.n_heads,
        "model n_kv_heads": args.n_kv_heads,
        "the vocabulary size": args.vocab_size,
    }
    if args.shared_hidden_dim:
        sizes["model shared_hidden_dim"] = args.shared_hidden_dim
    return sizes
