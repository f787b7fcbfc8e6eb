"""Renaming state-dict keys to and from Hugging Face names with templates (shared by the adapters).

A table maps our names to HF names, "{}" standing for a layer index:
    {"layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight", ...}
"""

import re


class NameMap:
    def __init__(self, ours_to_hf: dict[str, str]):
        self._to_hf = [(self._pattern(ours), hf) for ours, hf in ours_to_hf.items()]
        self._from_hf = [(self._pattern(hf), ours) for ours, hf in ours_to_hf.items()]

    @staticmethod
    def _pattern(template: str) -> re.Pattern:
        return re.compile("^" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")

    @staticmethod
    def _rename(name: str, table: list[tuple[re.Pattern, str]], direction: str) -> str:
        for pattern, target in table:
            match = pattern.match(name)
            if match:
                return target.format(*match.groups())
        raise KeyError(f"no {direction} counterpart known for '{name}'")

    def to_hf(self, name: str) -> str:
        return self._rename(name, self._to_hf, "Hugging Face")

    def from_hf(self, name: str) -> str:
        return self._rename(name, self._from_hf, "model")
