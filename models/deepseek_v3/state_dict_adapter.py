"""DeepSeek-V3-family state dicts to and from Hugging Face names (DeepSeek's released checkpoints, which
transformers' DeepseekV3ForCausalLM and DeepseekV2ForCausalLM load).

Names map one to one; RoPE already rotates interleaved pairs on both sides (transformers'
rope_interleave), so no rows are permuted. Each stacked expert tensor is one nn.Linear weight per
expert (`mlp.experts.E.gate_proj.weight`), as the released checkpoints store them; transformers 5
merges them when it loads. An MTP module is the layer after the main ones (`model.layers.61` at
DeepSeek-V3's 61 layers), holding, as DeepSeek's checkpoints do, copies of the embedding and the
output head (`embed_tokens`, `shared_head.head`): written on export, ignored on import.

Routing picks the transformers class: sigmoid scores (DeepSeek-V3, Moonlight, Kimi K2) export to
DeepseekV3ForCausalLM; softmax scores without renormalization or an expert bias, ranking groups by
their best expert (DeepSeek-V2, V2-Lite) to DeepseekV2ForCausalLM; anything else neither class
computes is refused, since its logits would differ.
"""

import torch

from configs import UserError
from models.deepseek_v3.model import DeepseekV3Args
from models.hf_adapter import StateDictAdapter, rope_config
from models.hf_names import NameMap

NAMES = NameMap(
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
        "layers.{}.attention.wq_a.weight": "model.layers.{}.self_attn.q_a_proj.weight",
        "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_a_layernorm.weight",
        "layers.{}.attention.wq_b.weight": "model.layers.{}.self_attn.q_b_proj.weight",
        "layers.{}.attention.wkv_a.weight": "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight",
        "layers.{}.attention.kv_norm.weight": "model.layers.{}.self_attn.kv_a_layernorm.weight",
        "layers.{}.attention.wkv_b.weight": "model.layers.{}.self_attn.kv_b_proj.weight",
        "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
        "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
        "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
        "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
        "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
        "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
        "layers.{}.moe.router.weight": "model.layers.{}.mlp.gate.weight",
        "layers.{}.moe.expert_bias": "model.layers.{}.mlp.gate.e_score_correction_bias",
        "layers.{}.moe.shared_experts.w1.weight": "model.layers.{}.mlp.shared_experts.gate_proj.weight",
        "layers.{}.moe.shared_experts.w2.weight": "model.layers.{}.mlp.shared_experts.down_proj.weight",
        "layers.{}.moe.shared_experts.w3.weight": "model.layers.{}.mlp.shared_experts.up_proj.weight",
        # Multi-token prediction (the layers after the main ones)
        "layers.{}.embedding_norm.weight": "model.layers.{}.enorm.weight",
        "layers.{}.hidden_norm.weight": "model.layers.{}.hnorm.weight",
        "layers.{}.projection.weight": "model.layers.{}.eh_proj.weight",
        "layers.{}.head_norm.weight": "model.layers.{}.shared_head.norm.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
EXPERT_NAMES = NameMap(
    {
        "layers.{}.moe.experts.w1": "model.layers.{}.mlp.experts.{}.gate_proj.weight",
        "layers.{}.moe.experts.w2": "model.layers.{}.mlp.experts.{}.down_proj.weight",
        "layers.{}.moe.experts.w3": "model.layers.{}.mlp.experts.{}.up_proj.weight",
    }
)
# Copies of the embedding and head in each MTP layer of DeepSeek's checkpoints ("{}": the layer):
# ours are the main ones.
MTP_COPIES = {
    "tok_embeddings.weight": "model.layers.{}.embed_tokens.weight",
    "output.weight": "model.layers.{}.shared_head.head.weight",
}
MTP_COPY_NAMES = NameMap({f"copy.{i}.{{}}": hf for i, hf in enumerate(MTP_COPIES.values())})


class DeepseekV3StateDictAdapter(StateDictAdapter):
    names = NAMES
    expert_names = EXPERT_NAMES
    args: DeepseekV3Args

    def _omitted_by_hf(self, name: str) -> bool:
        return False  # the embedding and the output head are never tied in this family

    def from_hf_name(self, hf_name: str) -> str | None:
        if MTP_COPY_NAMES.knows_hf(hf_name):
            return None
        return super().from_hf_name(hf_name)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.args.score_func == "softmax":  # DeepseekV2ForCausalLM has no expert bias
            biases = {name: t for name, t in state_dict.items() if name.endswith("moe.expert_bias")}
            if any(t.any() for t in biases.values()):
                raise UserError("DeepseekV2ForCausalLM has no expert bias, and this model's is not zero")
            state_dict = {name: t for name, t in state_dict.items() if name not in biases}
        hf = super().to_hf(state_dict)
        for layer in range(self.args.n_layers, self.args.n_layers + self.args.mtp_depth):
            for name, copy in MTP_COPIES.items():
                if name in state_dict:
                    hf[copy.format(layer)] = hf[NAMES.to_hf(name)].clone()
        return hf

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent transformers DeepseekV3ForCausalLM or DeepseekV2ForCausalLM."""
        a = self.args
        if a.shared_hidden_dim % a.expert_hidden_dim:
            raise UserError(
                f"shared_hidden_dim {a.shared_hidden_dim} is not a whole number of experts of "
                f"expert_hidden_dim {a.expert_hidden_dim}: Hugging Face counts shared experts"
            )
        common = {
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "moe_intermediate_size": a.expert_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads,
            "n_routed_experts": a.n_experts,
            "n_shared_experts": a.shared_hidden_dim // a.expert_hidden_dim,
            "num_experts_per_tok": a.top_k,
            "first_k_dense_replace": a.first_k_dense,
            "routed_scaling_factor": a.route_scale,
            "n_group": a.n_expert_groups,
            "topk_group": a.topk_groups,
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            **rope_config(a.rope_theta, self._yarn()),
            "max_position_embeddings": max(
                a.max_seq_len, int(a.rope_original_seq_len * max(a.rope_factor, 1))
            ),
            "vocab_size": a.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "dtype": dtype,
        }
        if a.score_func == "sigmoid":
            self._refuse({"group_score 'max'": a.group_score != "top2_sum"}, "DeepseekV3ForCausalLM")
            return {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                **common,
                "norm_topk_prob": a.renormalize,
                "topk_method": "noaux_tc",
                "scoring_func": "sigmoid",
                "rope_interleave": True,
                "num_nextn_predict_layers": a.mtp_depth,
            }
        self._refuse(
            {
                "renormalized gates": a.renormalize,
                "an expert bias": a.bias_update_rate != 0,
                "groups ranked by their two best experts": a.n_expert_groups > 1 and a.group_score != "max",
            },
            "DeepseekV2ForCausalLM (softmax routing)",
        )
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            **common,
            "norm_topk_prob": False,
            "topk_method": "group_limited_greedy" if a.n_expert_groups > 1 else "greedy",
            "scoring_func": "softmax",
        }

    def _yarn(self) -> dict | None:
        a = self.args
        if a.rope_factor <= 1:
            return None
        return {
            "rope_type": "yarn",
            "type": "yarn",
            "factor": a.rope_factor,
            "original_max_position_embeddings": a.rope_original_seq_len,
            "beta_fast": a.rope_beta_fast,
            "beta_slow": a.rope_beta_slow,
            "mscale": a.rope_mscale,
            "mscale_all_dim": a.rope_mscale_all_dim,
        }

    @staticmethod
    def _refuse(unsupported: dict[str, bool], target: str) -> None:
        names = [name for name, differs in unsupported.items() if differs]
        if names:
            raise UserError(
                f"{target} cannot route as this model does ({', '.join(names)}): an export would give "
                "other logits"
            )
