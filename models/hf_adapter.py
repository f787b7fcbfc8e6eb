"""What a model family's Hugging Face adapter provides (the base of each state_dict_adapter.py).

checkpoint/hf.py works one tensor at a time, and a rank of a sharded model reads only a box of
rows and columns of each tensor, so the adapter converts per tensor and per block of rows:

    from_hf_name(hf_name) / to_hf_name(name)   names only, no tensor (None: a tensor one side omits)
    rows_per_block(name)                       rows (dim 0) that convert together, e.g. one head
    block_from_hf(name, rows) / block_to_hf    convert whole blocks of rows (any columns)

A family whose layout equals Hugging Face's only sets `names` and `hf_config`; one that differs
overrides the three block methods. to_hf/from_hf apply the same methods to whole state dicts, so
full and sliced reads share one conversion path.
"""

import torch

from models.hf_names import NameMap


class StateDictAdapter:
    names: NameMap
    """Our names <-> Hugging Face names (set by the subclass)."""

    def __init__(self, args):
        self.args = args

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent transformers model (without tokenizer ids: the export adds them)."""
        raise NotImplementedError

    def _omitted_by_hf(self, name: str) -> bool:
        # Hugging Face stores tied weights once, as the embedding.
        return name == "output.weight" and self.args.tie_embeddings

    def from_hf_name(self, hf_name: str) -> str | None:
        """Our name for a Hugging Face tensor; None for one we do not keep. KeyError if unknown."""
        name = self.names.from_hf(hf_name)
        return None if self._omitted_by_hf(name) else name

    def to_hf_name(self, name: str) -> str | None:
        """The Hugging Face name of our tensor; None for one the export omits."""
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
            hf_name = self.to_hf_name(name)
            if hf_name is not None:
                hf[hf_name] = self.block_to_hf(name, tensor)
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole Hugging Face state dict (full tensors) in our names and layout."""
        ours = {}
        for hf_name, tensor in hf_state_dict.items():
            name = self.from_hf_name(hf_name)
            if name is not None:
                ours[name] = self.block_from_hf(name, tensor)
        return ours


def rope_config(theta: float, scaling: dict | None) -> dict:
    """config.json's RoPE keys, for every reader: transformers 5 reads rope_parameters; transformers
    4 and other tools (vLLM, llama.cpp's converter) read rope_theta and rope_scaling."""
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return {"rope_parameters": parameters, "rope_theta": theta, "rope_scaling": scaling}
