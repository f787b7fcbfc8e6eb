"""Config schema (schema.py), loading and checking (loader.py), reference docs (docs.py)."""

from configs.loader import ConfigError, config_to_toml, load_config
from configs.schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "config_to_toml", "load_config"]
