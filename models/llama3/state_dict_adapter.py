"""Llama 3 state dicts to and from Hugging Face `LlamaForCausalLM` names and layout.

Meta's RoPE rotates interleaved pairs; Hugging Face's rotates the two halves of each head. The same
model in HF layout therefore has the rows of wq and wk permuted within each head.
"""

import torch

from models.hf_adapter import StateDictAdapter, rope_config
from models.hf_names import NameMap
from models.llama3.model import Llama3Args

# Our name -> HF name; {} is the layer index.
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


NAMES = NameMap(_NAMES)
_PERMUTED = ("attention.wq.weight", "attention.wk.weight")


def _interleaved_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    count, cols = rows.shape
    return rows.view(count // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(count, cols)


def _halves_to_interleaved(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    count, cols = rows.shape
    return rows.view(count // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(count, cols)


class Llama3StateDictAdapter(StateDictAdapter):
    names = NAMES
    args: Llama3Args

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent transformers LlamaForCausalLM."""
        a = self.args
        scale = a.rope_scaling_factor
        scaling = None
        if scale != 1.0:
            scaling = {
                "rope_type": "llama3",
                "factor": scale,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_position,
            }
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.dim // a.n_heads,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            **rope_config(a.rope_theta, scaling),
            # transformers wants the scaling's original context below this: the context it stretches to.
            "max_position_embeddings": max(a.max_seq_len, int(a.rope_original_max_position * scale)),
            "vocab_size": a.vocab_size,
            "tie_word_embeddings": a.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "dtype": dtype,
        }

    def rows_per_block(self, name: str) -> int:
        """q and k rows are permuted within each head: a head converts as a whole."""
        return self.args.dim // self.args.n_heads if name.endswith(_PERMUTED) else 1

    def block_from_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return _halves_to_interleaved(rows, self.rows_per_block(name)) if name.endswith(_PERMUTED) else rows

    def block_to_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return _interleaved_to_halves(rows, self.rows_per_block(name)) if name.endswith(_PERMUTED) else rows
