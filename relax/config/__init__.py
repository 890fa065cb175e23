"""Structured configs, their Hydra registration, resolution and validation.

Layer 1 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""

from relax.config.compose import compose, conf_dir, load_config, to_relax_config
from relax.config.derive import resolve
from relax.config.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    RelaxConfig,
    RolloutConfig,
    TrackingConfig,
    TrainConfig,
)
from relax.config.store import register_configs
from relax.config.validate import ConfigError, validate

__all__ = [
    "ClusterConfig", "ConfigError", "DataConfig", "ModelConfig", "RelaxConfig", "RolloutConfig", "TrackingConfig",
    "TrainConfig", "compose", "conf_dir", "load_config", "register_configs", "resolve", "to_relax_config", "validate",
]
