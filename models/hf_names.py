"""Renaming state-dict keys to and from Hugging Face names with templates (shared by the adapters).

A table maps our names to HF names, "{}" standing for a layer index:
    {"layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight", ...}
An HF name may hold one index more than ours (the expert of a stacked expert tensor): to_hf takes
it as an extra argument, from_hf drops it and hf_extra_index returns it.
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
    def _match(name: str, table: list[tuple[re.Pattern, str]], direction: str) -> tuple[str, tuple[str, ...]]:
        for pattern, target in table:
            match = pattern.match(name)
            if match:
                return target, match.groups()
        raise KeyError(f"no {direction} counterpart known for '{name}'")

    def knows(self, name: str) -> bool:
        return any(pattern.match(name) for pattern, _ in self._to_hf)

    def knows_hf(self, name: str) -> bool:
        return any(pattern.match(name) for pattern, _ in self._from_hf)

    def to_hf(self, name: str, *extra: int) -> str:
        target, groups = self._match(name, self._to_hf, "Hugging Face")
        return target.format(*groups, *extra)

    def from_hf(self, name: str) -> str:
        target, groups = self._match(name, self._from_hf, "model")
        return target.format(*groups)  # format ignores an index our name does not hold

    def hf_extra_index(self, name: str) -> int:
        """The index an HF name holds beyond those of our name (the last one)."""
        return int(self._match(name, self._from_hf, "model")[1][-1])
