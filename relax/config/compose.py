"""From Hydra's composed DictConfig to one frozen, resolved and validated `RelaxConfig`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from relax.algorithms.base import Violation
from relax.config.derive import resolve
from relax.config.schema import RelaxConfig
from relax.config.store import register_configs
from relax.config.unknown_keys import compose_known, drop_extra_keys, extra_keys, unknown_key
from relax.config.validate import ConfigError, check, validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def conf_dir() -> Path:
    """The `conf/` directory of this checkout (Relax is installed editable: `pip install -e .`)."""
    if not (CONF_DIR / "config.yaml").is_file():
        raise FileNotFoundError(f"Relax's config directory {CONF_DIR} is missing; "
                                "install Relax with `pip install -e .`")
    return CONF_DIR


def to_relax_config(dc: DictConfig, unknown: Sequence[Violation] = ()) -> RelaxConfig:
    """Instantiate the frozen dataclasses, derive the None fields, validate (raises ConfigError). A key the schema
    lacks (`+train.foo=1`; `unknown`: those `compose_known` left out) is a violation, reported with all the others."""
    found = list(unknown)
    if extra_keys(dc):
        dc = dc.copy()
        found += drop_extra_keys(dc)
    obj = OmegaConf.to_object(dc)
    if not isinstance(obj, RelaxConfig):
        raise TypeError(f"composed config is {type(obj).__name__}, expected RelaxConfig")
    if not found:
        return check(resolve(obj))
    cfg = resolve(obj)
    raise ConfigError(found + validate(cfg), cfg.algorithm.name)


def compose(overrides: Sequence[str] = (), config_name: str = "config", conf: Path | None = None) -> DictConfig:
    """Compose `conf/config.yaml` (of `conf`, default this checkout's) with overrides, as `relax-train` does (for
    tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf or conf_dir()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def compose_checked(overrides: Sequence[str] = (), conf: Path | None = None) -> tuple[DictConfig, list[Violation]]:
    """compose, with each override of a key the schema lacks left out: (config, a violation per unknown key, those
    left out and those `+` added, each naming what was probably meant)."""
    dc, dropped = compose_known(lambda kept: compose(kept, conf=conf), overrides)
    return dc, [unknown_key(dc, key) for key in dropped] + [unknown_key(dc, key) for key in extra_keys(dc)]


def load_config(overrides: Sequence[str] = (), conf: Path | None = None) -> RelaxConfig:
    """compose + to_relax_config: the frozen, validated config of `relax-train <overrides>` (raises ConfigError with
    every problem, unknown keys included)."""
    dc, dropped = compose_known(lambda kept: compose(kept, conf=conf), overrides)
    return to_relax_config(dc, [unknown_key(dc, key) for key in dropped])
