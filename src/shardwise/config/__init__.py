"""Config: YAML + overrides -> typed objects (schema), dtype names, world-size checks."""

from shardwise.config.load import apply_overrides, config_from_dict, load_config
from shardwise.config.schema import Config

__all__ = ["Config", "apply_overrides", "config_from_dict", "load_config"]
