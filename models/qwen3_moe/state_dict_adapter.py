"""Qwen3-MoE state dicts to and from Hugging Face `Qwen3MoeForCausalLM` names.

Attention and norms map one to one as in Qwen3. Each stacked expert tensor (experts, in, out) is
128 Hugging Face tensors, one nn.Linear weight (out, in) per expert, as the released checkpoints
store them (`mlp.experts.E.gate_proj.weight`); transformers 5 merges them itself when it loads.
The export refuses routing that Qwen3MoeForCausalLM cannot express, since its logits would differ.
"""

from configs import UserError
from models.hf_adapter import StateDictAdapter, rope_config
from models.hf_names import NameMap
from models.qwen3_moe.model import Qwen3MoeArgs

NAMES = NameMap(
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
        "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
        "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
        "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
        "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
        "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
        "layers.{}.moe.router.weight": "model.layers.{}.mlp.gate.weight",
        "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
        "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
# The second "{}" of each Hugging Face name is the expert.
EXPERT_NAMES = NameMap(
    {
        "layers.{}.moe.experts.w1": "model.layers.{}.mlp.experts.{}.gate_proj.weight",
        "layers.{}.moe.experts.w2": "model.layers.{}.mlp.experts.{}.down_proj.weight",
        "layers.{}.moe.experts.w3": "model.layers.{}.mlp.experts.{}.up_proj.weight",
    }
)


class Qwen3MoeStateDictAdapter(StateDictAdapter):
    names = NAMES
    expert_names = EXPERT_NAMES
    args: Qwen3MoeArgs

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent transformers Qwen3MoeForCausalLM."""
        a = self.args
        unsupported = {
            "score_func": a.score_func != "softmax",
            "route_scale": a.route_scale != 1.0,
            "n_expert_groups": a.n_expert_groups != 1,
            "shared_hidden_dim": a.shared_hidden_dim != 0,
            "bias_update_rate": a.bias_update_rate != 0,  # a routing bias Qwen3-MoE does not have
        }
        if any(unsupported.values()):
            names = ", ".join(name for name, differs in unsupported.items() if differs)
            raise UserError(
                f"Qwen3MoeForCausalLM routes with softmax scores alone: it has no {names} like this "
                "model's, so an export would give other logits"
            )
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "num_experts": a.n_experts,
            "num_experts_per_tok": a.top_k,
            "moe_intermediate_size": a.expert_hidden_dim,
            "intermediate_size": a.top_k * a.expert_hidden_dim,  # dense layers' width; there are none
            "norm_topk_prob": a.renormalize,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": a.aux_loss_coeff,
            "output_router_logits": False,
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
