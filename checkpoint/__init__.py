"""Distributed checkpointing: the Checkpointer train.py holds (manager.py), saving (saving.py; the
async save in flight and its bounded wait: background.py) and resuming (loading.py) on any layout
through one storage interface (storage.py: plain DCP; fast_io/: the fast path), what a checkpoint
holds (state.py), the checksums that keep a damaged one from loading (integrity.py), whose run it
is (run_identity.py), Hugging Face files in and out (hf.py). docs/checkpointing.md explains it."""
