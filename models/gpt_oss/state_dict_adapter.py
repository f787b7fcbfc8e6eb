"""gpt-oss state dicts to and from Hugging Face `GptOssForCausalLM` names.

Everything maps one to one, the experts included: gpt-oss's checkpoints stack them as we do
(experts, in, out), the gate and up projections interleaved in one tensor (`gate_up_proj`), with
biases. OpenAI's released checkpoints store the experts' two weights in MXFP4
(`gate_up_proj_blocks` and `_scales`, read by checkpoint/mxfp4.py); an export writes them in the
export's dtype, as transformers' dequantized models are saved. The export refuses routing and
experts that GptOssForCausalLM cannot express, since its logits would differ.
"""

from configs import UserError
from models.gpt_oss.model import GptOssArgs
from models.hf_adapter import StateDictAdapter, rope_config
from models.hf_names import NameMap

NAMES = NameMap(
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        **{
            f"layers.{{}}.attention.{ours}.{kind}": f"model.layers.{{}}.self_attn.{theirs}.{kind}"
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
            for kind in ("weight", "bias")
        },
        "layers.{}.attention.sinks": "model.layers.{}.self_attn.sinks",
        "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
        "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
        "layers.{}.moe.router.weight": "model.layers.{}.mlp.router.weight",
        "layers.{}.moe.router.bias": "model.layers.{}.mlp.router.bias",
        "layers.{}.moe.experts.gate_up": "model.layers.{}.mlp.experts.gate_up_proj",
        "layers.{}.moe.experts.gate_up_bias": "model.layers.{}.mlp.experts.gate_up_proj_bias",
        "layers.{}.moe.experts.down": "model.layers.{}.mlp.experts.down_proj",
        "layers.{}.moe.experts.down_bias": "model.layers.{}.mlp.experts.down_proj_bias",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)


class GptOssStateDictAdapter(StateDictAdapter):
    names = NAMES
    args: GptOssArgs

    def _omitted_by_hf(self, name: str) -> bool:
        return False  # the embedding and the output head are never tied in this family

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent transformers GptOssForCausalLM."""
        a = self.args
        unsupported = {
            "score_func": a.score_func != "softmax",
            "renormalize": not a.renormalize,
            "route_scale": a.route_scale != 1.0,
            "n_expert_groups": a.n_expert_groups != 1,
            "shared_hidden_dim": a.shared_hidden_dim != 0,
            "bias_update_rate": a.bias_update_rate != 0,  # an expert bias GptOss does not have
            "router_bias": not a.router_bias,
            "expert_activation": a.expert_activation != "clamped_swiglu",
        }
        if any(unsupported.values()):
            names = ", ".join(name for name, differs in unsupported.items() if differs)
            raise UserError(
                f"GptOssForCausalLM routes with softmax over its biased router's top_k logits to clamped "
                f"SwiGLU experts: this model's {names} differ, so an export would give other logits"
            )
        yarn = None
        if a.rope_factor > 1:
            yarn = {"rope_type": "yarn", "factor": a.rope_factor, "beta_fast": a.rope_beta_fast,
                    "beta_slow": a.rope_beta_slow, "truncate": False,
                    "original_max_position_embeddings": a.rope_original_seq_len}  # fmt: skip
        windows = [a.window(layer) for layer in range(a.n_layers)]
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "sliding_window": a.sliding_window or None,
            "layer_types": ["sliding_attention" if window else "full_attention" for window in windows],
            "num_local_experts": a.n_experts,
            "num_experts_per_tok": a.top_k,
            "intermediate_size": a.expert_hidden_dim,
            "swiglu_alpha": a.swiglu_alpha,
            "swiglu_limit": a.swiglu_limit,
            "router_aux_loss_coef": a.aux_loss_coeff,
            "output_router_logits": False,
            "rms_norm_eps": a.norm_eps,
            **rope_config(a.rope_theta, yarn),
            "max_position_embeddings": max(a.max_seq_len, int(a.rope_original_seq_len * a.rope_factor)),
            "vocab_size": a.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": True,
            "hidden_act": "silu",
            "dtype": dtype,
        }
