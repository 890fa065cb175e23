"""Registers the schema dataclasses in Hydra's ConfigStore so that `conf/` YAML files can extend them.

Frozen dataclasses become read-only OmegaConf nodes, which Hydra cannot merge overrides into; the
stored nodes are therefore made writable here. Freezing comes back when the composed config is
turned into `RelaxConfig` instances (`relax.config.compose.to_relax_config`).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from relax import algorithms
from relax.config import schema

# group -> schema dataclass; each YAML option of the group starts with `defaults: [<group>_schema]`
GROUP_SCHEMAS = {
    "model": schema.ModelConfig,
    "teacher": schema.TeacherConfig,
    "reward_model": schema.RewardModelConfig,
    "cluster": schema.ClusterConfig,
    "rollout": schema.RolloutConfig,
    "data": schema.DataConfig,
}


def writable_node(cls: type) -> DictConfig:
    """The schema dataclass `cls` as an OmegaConf node that overrides and merges can write into."""
    node = OmegaConf.structured(cls)

    def clear(n: DictConfig | ListConfig) -> None:  # frozen dataclasses flag their own node (and only containers)
        OmegaConf.set_readonly(n, None)
        for key in (n.keys() if isinstance(n, DictConfig) else range(len(n))):
            if not OmegaConf.is_missing(n, key) and isinstance(child := n[key], (DictConfig, ListConfig)):
                clear(child)

    clear(node)
    return node


def schema_name(group: str, option: str | None = None) -> str:
    return f"{option or group}_schema"


_stored: tuple = ()  # the algorithm config classes the store holds nodes for (empty: nothing stored yet)


def register_configs() -> None:
    """Idempotent: stores every schema node, again when an algorithm was registered (or replaced) since the last
    call; otherwise nothing to do (storing them all is a good part of composing a config)."""
    global _stored
    current = tuple((name, algorithms.get(name).config_cls) for name in algorithms.names())
    if current == _stored and ConfigStore.instance().repo.get("relax_schema.yaml") is not None:
        return
    _stored = current
    cs = ConfigStore.instance()
    cs.store(name="relax_schema", node=writable_node(schema.RelaxConfig))
    for group, cls in GROUP_SCHEMAS.items():
        cs.store(group=group, name=schema_name(group), node=writable_node(cls))
    for name in algorithms.names():
        node = writable_node(algorithms.get(name).config_cls)
        cs.store(group="algorithm", name=schema_name("algorithm", name), node=node)
