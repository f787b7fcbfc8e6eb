"""Config schema (schema.py), loading and checking (loader.py), reference docs (docs.py), and the
one error type for user mistakes (errors.py)."""

from configs.errors import UserError
from configs.loader import config_to_toml, load_config
from configs.schema import JobConfig

__all__ = ["JobConfig", "UserError", "config_to_toml", "load_config"]
