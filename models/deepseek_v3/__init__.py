"""DeepSeek-V3 family: flavors with the published shapes (DeepSeek-V2-Lite, DeepSeek-V2, DeepSeek-V3,
Moonlight, Kimi K2), debug flavors for CPU, and the spec that registers them.

Shapes, routing and YaRN are those of each model's config.json (DeepSeek's inference/configs for
16B, 236B and 671B agree on the shapes; for 236B they give mscale 1.0, DeepSeek-V2.5's, where V2's
config.json has 0.707). Balancing: the configs' aux_loss_alpha as the per-sequence balance loss,
and for sigmoid routing the bias step of DeepSeek-V3's paper (1e-3).
"""

from models.deepseek_v3.model import DeepseekV3Args, Transformer
from models.deepseek_v3.parallelize import tensor_parallel_plan, tensor_parallel_sizes
from models.deepseek_v3.state_dict_adapter import DeepseekV3StateDictAdapter
from models.spec import ModelSpec

# YaRN as the published configs set it (rope_scaling of their config.json).
V2_YARN = dict(rope_factor=40.0, rope_original_seq_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
               rope_mscale=0.707, rope_mscale_all_dim=0.707)  # fmt: skip
V3_YARN = dict(rope_factor=40.0, rope_original_seq_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
               rope_mscale=1.0, rope_mscale_all_dim=1.0)  # fmt: skip
# DeepSeek-V3's MoE: 256 experts in 8 groups, 4 of which a token may use, sigmoid scores, bias balancing.
V3_ROUTING = dict(score_func="sigmoid", renormalize=True, route_scale=2.5, n_expert_groups=8, topk_groups=4,
                  bias_update_rate=1e-3, aux_loss_coeff=1e-4)  # fmt: skip

flavors = {
    # Tiny shapes for tests; vocab_size 0 = the tokenizer's. Every option on: low-rank queries,
    # YaRN stretching a 16-token context (so it acts at the tests' 32 tokens), DeepSeek-V3 routing
    # with groups, a shared expert, bias balancing and a balance loss, and one MTP depth. Widths
    # are multiples of 4 so that the fp32 grouped GEMM's rows stay 16-byte aligned.
    "tiny": DeepseekV3Args(
        dim=64, n_layers=3, n_heads=4, vocab_size=0, ffn_hidden_dim=128, first_k_dense=1, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_factor=4.0,
        rope_original_seq_len=16, rope_mscale=1.0, rope_mscale_all_dim=1.0, n_experts=8, top_k=2,
        expert_hidden_dim=32, score_func="sigmoid", route_scale=2.5, n_expert_groups=4, topk_groups=2,
        shared_hidden_dim=32, bias_update_rate=1e-3, aux_loss_coeff=1e-4, mtp_depth=1,
    ),
    "debugmodel": DeepseekV3Args(
        dim=256, n_layers=4, n_heads=8, vocab_size=0, ffn_hidden_dim=768, first_k_dense=1, q_lora_rank=128,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_factor=4.0,
        rope_original_seq_len=64, rope_mscale=1.0, rope_mscale_all_dim=1.0, n_experts=16, top_k=4,
        expert_hidden_dim=128, score_func="sigmoid", route_scale=2.5, n_expert_groups=4, topk_groups=2,
        shared_hidden_dim=128, bias_update_rate=1e-3, aux_loss_coeff=1e-4, mtp_depth=1,
    ),
    # DeepSeek-V2-Lite: queries through one projection, softmax routing without groups, no renormalization.
    "16B": DeepseekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_hidden_dim=10944, first_k_dense=1,
        q_lora_rank=0, kv_lora_rank=512, n_experts=64, top_k=6, expert_hidden_dim=1408, score_func="softmax",
        renormalize=False, shared_hidden_dim=2 * 1408, aux_loss_coeff=1e-3, **V2_YARN,
    ),
    # Moonshot's Moonlight: DeepSeek-V3's decoder at the 16B shape, sigmoid routing without groups.
    "moonlight_16B_A3B": DeepseekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=163840, ffn_hidden_dim=11264, first_k_dense=1,
        q_lora_rank=0, kv_lora_rank=512, n_experts=64, top_k=6, expert_hidden_dim=1408,
        score_func="sigmoid", route_scale=2.446, shared_hidden_dim=2 * 1408, bias_update_rate=1e-3,
        aux_loss_coeff=1e-3, rope_theta=50000.0, norm_eps=1e-5,
    ),
    # DeepSeek-V2: softmax routing over groups ranked by their best expert, no renormalization.
    "236B": DeepseekV3Args(
        dim=5120, n_layers=60, n_heads=128, vocab_size=102400, ffn_hidden_dim=12288, first_k_dense=1,
        q_lora_rank=1536, kv_lora_rank=512, n_experts=160, top_k=6, expert_hidden_dim=1536,
        score_func="softmax", renormalize=False, route_scale=16.0, n_expert_groups=8, topk_groups=3,
        group_score="max", shared_hidden_dim=2 * 1536, aux_loss_coeff=1e-3, **V2_YARN,
    ),
    "671B": DeepseekV3Args(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_dim=18432, first_k_dense=3,
        q_lora_rank=1536, kv_lora_rank=512, n_experts=256, top_k=8, expert_hidden_dim=2048,
        shared_hidden_dim=2048, mtp_depth=1, **V3_ROUTING, **V3_YARN,
    ),
    # Moonshot's Kimi K2: DeepSeek-V3's decoder with 384 experts, 64 heads, one dense block.
    "kimi_k2": DeepseekV3Args(
        dim=7168, n_layers=61, n_heads=64, vocab_size=163840, ffn_hidden_dim=18432, first_k_dense=1,
        q_lora_rank=1536, kv_lora_rank=512, n_experts=384, top_k=8, expert_hidden_dim=2048,
        score_func="sigmoid", route_scale=2.827, shared_hidden_dim=2048, bias_update_rate=1e-3,
        aux_loss_coeff=1e-3, rope_theta=50000.0,
        rope_factor=32.0, rope_original_seq_len=4096, rope_beta_fast=1.0, rope_beta_slow=1.0,
        rope_mscale=1.0, rope_mscale_all_dim=1.0,
    ),
}  # fmt: skip


def last_stage(args: DeepseekV3Args) -> tuple[str, ...]:
    """The MTP modules run on the main model's last hidden state and read the embedding: the last
    pipeline stage holds them, and a copy of the embedding (parallelisms/pipeline.py, StageCopies)."""
    mtp = tuple(f"layers.{i}" for i in range(args.n_layers, args.n_layers + args.mtp_depth))
    return (*mtp, "tok_embeddings") if mtp else ()


spec = ModelSpec(
    name="deepseek_v3",
    model_cls=Transformer,
    flavors=flavors,
    state_dict_adapter=DeepseekV3StateDictAdapter,
    head=("tok_embeddings",),
    tail=("norm", "output"),
    tensor_parallel_plan=tensor_parallel_plan,
    tensor_parallel_sizes=tensor_parallel_sizes,
    last_stage=last_stage,
)
