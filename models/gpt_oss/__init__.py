"""gpt-oss family: flavors with the published shapes (config.json of openai/gpt-oss-20b and
openai/gpt-oss-120b), debug flavors for CPU, and the spec that registers them.

The balance loss: transformers' GptOssConfig sets router_aux_loss_coef 1e-3 (OpenAI did not publish
how it balanced); here 1e-3 weighs the per-sequence loss of each layer (docs/moe.md).
"""

from models.decoder_plans import HEAD, TAIL
from models.gpt_oss.model import GptOssArgs, Transformer
from models.gpt_oss.parallelize import tensor_parallel_plan, tensor_parallel_sizes
from models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from models.spec import ModelSpec

V = 201088  # the o200k_harmony vocabulary

flavors = {
    # Tiny shapes for tests; vocab_size 0 = the tokenizer's. A window of 6 is shorter than a
    # context-parallel chunk of tests/tiny.toml's 32 tokens at CP 2 (8), so it cuts inside chunks
    # and reaches across their edges; YaRN stretches a 16-token context, so it acts at 32 tokens.
    # Widths are multiples of 4 so that the fp32 grouped GEMM's rows stay 16-byte aligned.
    # The debug flavor's window of 8 slides too: at seq 64 under CP 2 a chunk of 16 queries needs
    # at most 23 of the 64 keys in its sliding blocks, and under CP 4 whole chunks fall outside.
    "tiny": GptOssArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=0, n_experts=8,
                       top_k=2, expert_hidden_dim=32, sliding_window=6, rope_factor=4.0,
                       rope_original_seq_len=16, aux_loss_coeff=1e-3),
    "debugmodel": GptOssArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, vocab_size=0,
                             n_experts=8, top_k=2, expert_hidden_dim=256, sliding_window=8, rope_factor=4.0,
                             rope_original_seq_len=64, aux_loss_coeff=1e-3),
    "20B": GptOssArgs(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=V,
                      n_experts=32, top_k=4, expert_hidden_dim=2880, aux_loss_coeff=1e-3),
    "120B": GptOssArgs(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=V,
                       n_experts=128, top_k=4, expert_hidden_dim=2880, aux_loss_coeff=1e-3),
}  # fmt: skip


spec = ModelSpec(
    name="gpt_oss",
    model_cls=Transformer,
    flavors=flavors,
    state_dict_adapter=GptOssStateDictAdapter,
    head=HEAD,
    tail=TAIL,
    tensor_parallel_plan=tensor_parallel_plan,
    tensor_parallel_sizes=tensor_parallel_sizes,
)
