"""Llama 3 family: flavors with Meta's shapes, and the spec that registers them."""

from models.decoder_plans import HEAD, TAIL, tensor_parallel_sizes
from models.llama3.model import Llama3Args, Transformer
from models.llama3.parallelize import tensor_parallel_plan
from models.llama3.state_dict_adapter import Llama3StateDictAdapter
from models.spec import ModelSpec

flavors = {
    # Tiny shapes for tests and laptops; vocab_size 0 = the tokenizer's (byte tokenizer: 258 -> 320).
    "tiny": Llama3Args(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden_dim=128, vocab_size=0),
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, ffn_hidden_dim=768, vocab_size=0),
    # Llama 3.2 (tied embeddings, RoPE scaling factor 32).
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=8192,
        vocab_size=128256,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_hidden_dim=8192,
        vocab_size=128256,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
    ),
    # Llama 3.1 (RoPE scaling factor 8).
    "8B": Llama3Args(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, vocab_size=128256
    ),
    "70B": Llama3Args(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, vocab_size=128256
    ),
    "405B": Llama3Args(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_dim=53248, vocab_size=128256
    ),
}


spec = ModelSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=flavors,
    state_dict_adapter=Llama3StateDictAdapter,
    head=HEAD,
    tail=TAIL,
    tensor_parallel_plan=tensor_parallel_plan,
    tensor_parallel_sizes=tensor_parallel_sizes,
)
