"""Distributed checkpointing (DCP save/load, resharding, Hugging Face import/export).

Being built: see docs/architecture.md for the plan.
"""
