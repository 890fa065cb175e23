"""From Hydra's composed DictConfig to one frozen, resolved and validated `RelaxConfig`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from relax.config.derive import resolve
from relax.config.schema import RelaxConfig
from relax.config.store import register_configs
from relax.config.validate import check

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def conf_dir() -> Path:
    """The `conf/` directory of this checkout (Relax is installed editable: `pip install -e .`)."""
    if not (CONF_DIR / "config.yaml").is_file():
        raise FileNotFoundError(f"Relax's config directory {CONF_DIR} is missing; "
                                "install Relax with `pip install -e .`")
    return CONF_DIR


def to_relax_config(dc: DictConfig) -> RelaxConfig:
    """Instantiate the frozen dataclasses, derive the None fields, validate (raises ConfigError)."""
    obj = OmegaConf.to_object(dc)
    if not isinstance(obj, RelaxConfig):
        raise TypeError(f"composed config is {type(obj).__name__}, expected RelaxConfig")
    return check(resolve(obj))


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose `conf/config.yaml` with overrides, as `relax-train` does (for tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def load_config(overrides: Sequence[str] = ()) -> RelaxConfig:
    """compose + to_relax_config: the frozen, validated config of `relax-train <overrides>`."""
    return to_relax_config(compose(overrides))
