"""Typed, layered TOML configs: `load_config(Root, ["@", "a.toml", "x.y=1"])`."""

from primerl_protocol.config.base import (
    Config,
    ModelConfig,
    NonNegative,
    Port,
    Positive,
    SharedConfig,
    TransportConfig,
    WandbConfig,
)
from primerl_protocol.config.docs import class_doc, field_docs, sections
from primerl_protocol.config.dump import to_toml, write_private
from primerl_protocol.config.load import (
    ConfigError,
    compose,
    load_config,
    split_args,
    validate,
)

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "NonNegative",
    "Port",
    "Positive",
    "SharedConfig",
    "TransportConfig",
    "WandbConfig",
    "class_doc",
    "compose",
    "field_docs",
    "load_config",
    "sections",
    "split_args",
    "to_toml",
    "write_private",
    "validate",
]
