"""From Hydra's composed DictConfig to one frozen, resolved and validated `RelaxConfig`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from relax import algorithms
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


def resolve(cfg: RelaxConfig) -> RelaxConfig:
    """Fill the fields whose default is None ("derived") from the algorithm and the batch sizes."""
    algo = algorithms.get(cfg.algorithm.name)
    t, ro = cfg.train, cfg.rollout
    samples = ro.rollout_batch_size * ro.n_samples_per_prompt
    steps, gbs = t.num_steps_per_rollout, t.global_batch_size
    if gbs is None:
        steps = 1 if steps is None else steps
        gbs = max(1, samples // steps) if steps and steps > 0 else samples
    elif steps is None:
        steps = max(1, samples // gbs) if gbs > 0 else 1
    per_token = algo.per_token_loss if t.calculate_per_token_loss is None else t.calculate_per_token_loss
    staleness = t.max_staleness if t.max_staleness is not None else (0 if t.mode == "sync" else 1)
    train = dataclasses.replace(t, global_batch_size=gbs, num_steps_per_rollout=steps,
                                calculate_per_token_loss=per_token, max_staleness=staleness)
    # dynamic sampling's generation rounds draw rollout_batch_size prompts unless told otherwise (no rounds: None)
    over = ro.over_sampling_batch_size
    if over is None and ro.filter_groups:
        over = ro.rollout_batch_size
    rollout = dataclasses.replace(ro, over_sampling_batch_size=over)
    return dataclasses.replace(cfg, train=train, rollout=rollout)


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
