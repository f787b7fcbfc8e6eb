"""Tied weights (one parameter under two names) survive operations that replace parameters module
by module, such as to_empty() or a tensor-parallel plan, only if re-tied afterwards."""

from torch import nn


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of names that refer to one shared parameter (e.g. tied embedding and output)."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return [names for names in names_of.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Point every name of each group back at the group's first parameter."""
    for first, *others in groups:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)
