"""The model registry: `model.name` -> the package whose `spec` (a ModelSpec) describes the family.

A forked model folder is registered by one line here.
"""

import difflib
import importlib

from configs import UserError
from models.spec import ModelSpec

MODEL_PACKAGES = {
    "llama3": "models.llama3",
    "qwen3": "models.qwen3",
    "qwen3_moe": "models.qwen3_moe",
    "deepseek_v3": "models.deepseek_v3",
    "gpt_oss": "models.gpt_oss",
}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_PACKAGES:
        match = difflib.get_close_matches(name, list(MODEL_PACKAGES), n=1)
        hint = f" (did you mean '{match[0]}'?)" if match else ""
        raise UserError(f"model.name '{name}' is not registered in models/__init__.py{hint}")
    return importlib.import_module(MODEL_PACKAGES[name]).spec


def check_flavor(spec: ModelSpec, flavor: str) -> None:
    if flavor not in spec.flavors:
        match = difflib.get_close_matches(flavor, list(spec.flavors), n=1)
        hint = f" (did you mean '{match[0]}'?)" if match else ""
        known = ", ".join(spec.flavors)
        raise UserError(f"model.flavor '{flavor}' is not a {spec.name} flavor ({known}){hint}")
