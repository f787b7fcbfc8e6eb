"""What a model family's Hugging Face adapter provides (the base of each state_dict_adapter.py).

checkpoint/hf.py works one tensor at a time, and a rank of a sharded model reads only a box of
rows and columns of each tensor, so the adapter converts per tensor and per block of rows:

    from_hf_name(hf_name) / to_hf_name(name)   names only, no tensor (None: a tensor one side omits)
    rows_per_block(name)                       rows (dim 0) that convert together, e.g. one head
    block_from_hf(name, rows) / block_to_hf    convert whole blocks of rows (any columns)

A family whose layout equals Hugging Face's only sets `names` and `hf_config`; one that differs
overrides the three block methods. to_hf/from_hf apply the same methods to whole state dicts, so
full and sliced reads share one conversion path.

Mixture-of-Experts weights are one tensor here and many there: our stacked (experts, in, out)
tensor holds one Hugging Face nn.Linear weight (out, in) per expert, transposed. `expert_names`
maps them (the HF name holds the expert index too); a rank reads only the experts of its shard.
"""

from collections import defaultdict

import torch

from models.hf_names import NameMap


class StateDictAdapter:
    names: NameMap
    """Our names <-> Hugging Face names (set by the subclass)."""
    expert_names: NameMap | None = None
    """Our stacked expert tensors <-> their per-expert Hugging Face tensors, whose names hold one
    "{}" more: the expert (models with experts only)."""

    def __init__(self, args):
        self.args = args

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent transformers model (without tokenizer ids: the export adds them)."""
        raise NotImplementedError

    def _omitted_by_hf(self, name: str) -> bool:
        # Hugging Face stores tied weights once, as the embedding.
        return name == "output.weight" and self.args.tie_embeddings

    def is_stacked(self, name: str) -> bool:
        """Whether our tensor `name` stacks per-expert Hugging Face tensors along dim 0."""
        return self.expert_names is not None and self.expert_names.knows(name)

    def expert_index(self, hf_name: str) -> int | None:
        """The expert (index in dim 0 of our stacked tensor) a Hugging Face tensor holds; None for
        a tensor that is one of ours whole."""
        if self.expert_names is not None and self.expert_names.knows_hf(hf_name):
            return self.expert_names.hf_extra_index(hf_name)
        return None

    def from_hf_name(self, hf_name: str) -> str | None:
        """Our name for a Hugging Face tensor (an expert's: our stacked tensor's); None for one we
        do not keep. KeyError if unknown."""
        if self.expert_index(hf_name) is not None:
            return self.expert_names.from_hf(hf_name)
        name = self.names.from_hf(hf_name)
        return None if self._omitted_by_hf(name) else name

    def to_hf_name(self, name: str, expert: int | None = None) -> str | None:
        """The Hugging Face name of our tensor (of one expert of a stacked tensor); None for one the
        export omits."""
        if self.is_stacked(name):
            return self.expert_names.to_hf(name, expert)
        return None if self._omitted_by_hf(name) else self.names.to_hf(name)

    def rows_per_block(self, name: str) -> int:
        """Rows (dim 0) of our tensor `name` that convert together; 1 where the layouts agree."""
        return 1

    def block_from_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Our layout of `rows`: whole blocks of rows (any columns) of Hugging Face's tensor."""
        return rows

    def block_to_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Hugging Face's layout of `rows`: whole blocks of rows (any columns) of our tensor."""
        return rows

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole state dict (full tensors, our names) in Hugging Face names and layout."""
        hf = {}
        for name, tensor in state_dict.items():
            if self.is_stacked(name):
                hf.update({self.to_hf_name(name, expert): weight.T for expert, weight in enumerate(tensor)})
                continue
            hf_name = self.to_hf_name(name)
            if hf_name is not None:
                hf[hf_name] = self.block_to_hf(name, tensor)
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole Hugging Face state dict (full tensors) in our names and layout."""
        ours, experts = {}, defaultdict(dict)
        for hf_name, tensor in hf_state_dict.items():
            name = self.from_hf_name(hf_name)
            expert = self.expert_index(hf_name)
            if expert is not None:
                experts[name][expert] = tensor.T
            elif name is not None:
                ours[name] = self.block_from_hf(name, tensor)
        for name, weights in experts.items():
            ours[name] = torch.stack([weights[expert] for expert in range(len(weights))])
        return ours


def rope_config(theta: float, scaling: dict | None) -> dict:
    """config.json's RoPE keys, for every reader: transformers 5 reads rope_parameters; transformers
    4 and other tools (vLLM, llama.cpp's converter) read rope_theta and rope_scaling."""
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return {"rope_parameters": parameters, "rope_theta": theta, "rope_scaling": scaling}
