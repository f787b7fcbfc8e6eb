"""Parameter names as the plain model has them: torch.compile and activation checkpointing wrap a
block and insert their wrappers' names into its parameters' names; checkpoints, seeded init and the
Hugging Face adapters use the names without them, the same on every layout."""

# Names that wrappers (torch.compile, activation checkpointing) insert into parameter names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def original_name(fqn: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn
