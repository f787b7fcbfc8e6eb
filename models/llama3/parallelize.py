"""How Llama 3 is split by tensor parallelism: the standard decoder plan (models/decoder_plans.py),
which fits this model as it is."""

from models.decoder_plans import decoder_plan as tensor_parallel_plan

__all__ = ["tensor_parallel_plan"]
