"""How Qwen3 is split by tensor parallelism: the standard decoder plan plus its QK-norm.

The q/k norms act on each head, and under tensor parallelism a rank holds some of the heads: they
run as sequence-parallel norms over the head dimension (dim 2 of batch, seq, heads, head_dim), so
their weight stays one replicated parameter whose gradient sums over all heads' ranks.
"""

from torch.distributed.tensor.parallel import SequenceParallel

from models.decoder_plans import block_plan, root_plan
from models.spec import TensorParallelPlan


def tensor_parallel_plan(args, loss_parallel: bool) -> TensorParallelPlan:
    qk_norms = {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    return TensorParallelPlan(root=root_plan(loss_parallel), block=block_plan() | qk_norms)
