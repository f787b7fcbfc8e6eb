"""Qwen3 dense family: flavors with the official shapes, and the spec that registers them."""

from models.decoder_plans import HEAD, TAIL, tensor_parallel_sizes
from models.qwen3.model import Qwen3Args, Transformer
from models.qwen3.parallelize import tensor_parallel_plan
from models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from models.spec import ModelSpec

V = 151936  # Qwen3 vocabulary

flavors = {
    # Tiny shapes for tests; vocab_size 0 = the tokenizer's. head_dim x heads != dim, as in Qwen3.
    "tiny": Qwen3Args(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16, ffn_hidden_dim=128,
                      vocab_size=0),
    "debugmodel": Qwen3Args(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=4, head_dim=32, ffn_hidden_dim=768, vocab_size=0
    ),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_hidden_dim=3072,
                      vocab_size=V, tie_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_hidden_dim=6144,
                      vocab_size=V, tie_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_hidden_dim=9728,
                    vocab_size=V, tie_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_hidden_dim=12288,
                    vocab_size=V),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128, ffn_hidden_dim=17408,
                     vocab_size=V),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, ffn_hidden_dim=25600,
                     vocab_size=V),
}  # fmt: skip


spec = ModelSpec(
    name="qwen3",
    model_cls=Transformer,
    flavors=flavors,
    state_dict_adapter=Qwen3StateDictAdapter,
    head=HEAD,
    tail=TAIL,
    tensor_parallel_plan=tensor_parallel_plan,
    tensor_parallel_sizes=tensor_parallel_sizes,
)
