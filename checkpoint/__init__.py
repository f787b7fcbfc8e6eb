"""Distributed checkpointing: saving and resuming on any layout (manager.py), what a checkpoint holds
(state.py), the checksums that keep a damaged one from loading (integrity.py), Hugging Face files in
and out (hf.py). docs/checkpointing.md explains the format."""
