"""Qwen3 state dicts to and from Hugging Face `Qwen3ForCausalLM` names (same RoPE layout: no
permutation, only names)."""

from models.hf_adapter import StateDictAdapter, rope_config
from models.hf_names import NameMap
from models.qwen3.model import Qwen3Args

NAMES = NameMap(
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
        "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
        "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
        "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
        "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
        "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
        "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
        "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
        "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
        "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
        "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)


class Qwen3StateDictAdapter(StateDictAdapter):
    names = NAMES
    args: Qwen3Args

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent transformers Qwen3ForCausalLM."""
        a = self.args
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            **rope_config(a.rope_theta, scaling=None),
            "max_position_embeddings": max(a.max_seq_len, 40960),
            "vocab_size": a.vocab_size,
            "tie_word_embeddings": a.tie_embeddings,
            "attention_bias": False,
            "use_sliding_window": False,
            "dtype": dtype,
        }
