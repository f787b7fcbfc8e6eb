"""Qwen3-MoE family: flavors with the official shapes (Hugging Face config.json of Qwen3-30B-A3B and
Qwen3-235B-A22B), debug flavors for CPU, and the spec that registers them."""

from models.decoder_plans import HEAD, TAIL
from models.qwen3_moe.model import Qwen3MoeArgs, Transformer
from models.qwen3_moe.parallelize import tensor_parallel_plan, tensor_parallel_sizes
from models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
from models.spec import ModelSpec

V = 151936  # Qwen3 vocabulary

flavors = {
    # Tiny shapes for tests; vocab_size 0 = the tokenizer's. Widths are multiples of 4 so that the
    # fp32 grouped GEMM's rows stay 16-byte aligned.
    "tiny": Qwen3MoeArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=0,
                         n_experts=8, top_k=2, expert_hidden_dim=32),
    "debugmodel": Qwen3MoeArgs(dim=256, n_layers=4, n_heads=16, n_kv_heads=4, head_dim=32, vocab_size=0,
                               n_experts=8, top_k=2, expert_hidden_dim=384, aux_loss_coeff=1e-3),
    # DeepSeek-V3's routing on the debug shapes: sigmoid scores, 4 groups of 4 experts of which a
    # token may use 2 groups, scaled gates, a shared expert, bias balancing and a small balance loss.
    "debugmodel_deepseek": Qwen3MoeArgs(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=4, head_dim=32, vocab_size=0, n_experts=16, top_k=4,
        expert_hidden_dim=128, score_func="sigmoid", route_scale=2.5, n_expert_groups=4, topk_groups=2,
        shared_hidden_dim=256, bias_update_rate=1e-3, aux_loss_coeff=1e-4,
    ),
    # Official shapes. Qwen3 trained with a global-batch balance loss of coefficient 1e-3
    # (router_aux_loss_coef); here 1e-3 weighs the per-sequence loss of each layer (docs/moe.md).
    "30B-A3B": Qwen3MoeArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=V,
                            n_experts=128, top_k=8, expert_hidden_dim=768, aux_loss_coeff=1e-3),
    "235B-A22B": Qwen3MoeArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, vocab_size=V,
                              n_experts=128, top_k=8, expert_hidden_dim=1536, aux_loss_coeff=1e-3),
}  # fmt: skip


spec = ModelSpec(
    name="qwen3_moe",
    model_cls=Transformer,
    flavors=flavors,
    state_dict_adapter=Qwen3MoeStateDictAdapter,
    head=HEAD,
    tail=TAIL,
    tensor_parallel_plan=tensor_parallel_plan,
    tensor_parallel_sizes=tensor_parallel_sizes,
)
