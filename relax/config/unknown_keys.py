"""Keys that the schema lacks: a misspelled field (`train.lrr`), another algorithm's option (`algorithm.kl2_budget`
without algorithm=m2po), a field `+`-added to a section. Each becomes one violation that names the key and what was
meant (the closest fields, or the algorithms whose config has it), reported with every other problem of the config.

Hydra refuses an override of a key a structured config lacks (with its advice to append it with `+`, which the
frozen dataclasses then refuse); `compose_known` leaves such overrides out and names them instead, and
`extra_keys` finds the keys that `+` added.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from relax import algorithms
from relax.algorithms.base import Violation


def _fields(node: Any) -> list[str] | None:
    """The field names of the schema dataclass behind `node`, None when it is not one (a free dict, a value)."""
    if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
        return None
    t = OmegaConf.get_type(node)
    return [f.name for f in dataclasses.fields(t)] if dataclasses.is_dataclass(t) else None


def _algorithms_with(field: str) -> list[str]:
    return [n for n in algorithms.names()
            if any(f.name == field for f in dataclasses.fields(algorithms.get(n).config_cls))]


def unknown_key(cfg: DictConfig, key: str) -> Violation:
    """The violation of `key` (dotted), a key the schema of the composed `cfg` lacks."""
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        fields = _fields(node)
        if fields is None:  # a free-form section: its keys are not checked
            break
        if part in fields:
            node = node._get_node(part)
            continue
        prefix = ".".join(parts[:i])
        if prefix == "algorithm" and i == 1:
            current = OmegaConf.select(cfg, "algorithm.name", default=None)
            owners = _algorithms_with(part)
            if owners:
                options = " or ".join(f"algorithm={n}" for n in owners)
                fix = f"set algorithm={owners[0]}" if len(owners) == 1 else "set one of them"
                return Violation((key, "algorithm"),
                                 f"{key} is an option of {options}, not of algorithm={current} ({fix})")
        close = difflib.get_close_matches(part, fields, n=3)
        rest = "".join(f".{p}" for p in parts[i + 1:])  # `trian.lr`: did you mean train.lr?
        if rest:  # a misspelled section: the close ones that have the rest of the key
            close = [c for c in close if parts[i + 1] in (_fields(node._get_node(c)) or ())] or close
        hint = f" (did you mean {' or '.join(f'{prefix}.{c}{rest}' if prefix else c + rest for c in close)}?)"
        where = f"{prefix} has no key {part!r}" if prefix else "no such section or key"
        return Violation((key,), f"unknown key {key}{hint}" if close else f"unknown key {key}: {where}")
    return Violation((key,), f"unknown key {key}")


def extra_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """The dotted keys of `cfg` that its schema dataclasses lack (added with `+key=value`)."""
    fields = _fields(cfg)
    if fields is None:
        return []
    out = []
    for k in cfg.keys():
        key = f"{prefix}{k}"
        if k not in fields:
            if key != "hydra":  # Hydra's own node, where a composition keeps it
                out.append(key)
        else:
            out += extra_keys(cfg._get_node(k), key + ".")
    return out


def drop_extra_keys(cfg: DictConfig) -> list[Violation]:
    """Remove the keys `extra_keys` finds from `cfg` (so that the rest can be built and checked); their violations."""
    found = extra_keys(cfg)
    violations = [unknown_key(cfg, key) for key in found]
    for key in found:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        with open_dict(node):
            del node[leaf]
    return violations


def _unknown_override(exc: BaseException, overrides: Sequence[str]) -> int | None:
    """The index of the override that Hydra refused because the schema lacks its key, else None."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__ or exc.__context__
    full_key = getattr(cause, "full_key", None)
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or not full_key:
        return None
    for i, o in enumerate(overrides):
        key = o.split("=", 1)[0].lstrip("+~")
        if key == full_key or key.startswith(full_key + "."):
            return i
    return None


def compose_known(compose: Any, overrides: Sequence[str]) -> tuple[DictConfig, list[str]]:
    """`compose(overrides)`, leaving out each override whose key the schema lacks: (config, the keys left out)."""
    from hydra.errors import ConfigCompositionException

    kept, dropped = list(overrides), []
    while True:
        try:
            return compose(kept), dropped
        except ConfigCompositionException as exc:
            i = _unknown_override(exc, kept)
            if i is None:
                raise
            dropped.append(kept.pop(i).split("=", 1)[0].lstrip("+~"))
