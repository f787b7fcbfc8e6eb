"""Parallelisms (FSDP2/HSDP, tensor, pipeline and context parallelism) applied from [parallelism].

Being built: until then train.py runs one process (see docs/architecture.md for the plan).
"""
