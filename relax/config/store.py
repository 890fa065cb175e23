"""Registers the schema dataclasses in Hydra's ConfigStore so that `conf/` YAML files can extend them.

Frozen dataclasses become read-only OmegaConf nodes, which Hydra cannot merge overrides into; the
stored nodes are therefore made writable here. Freezing comes back when the composed config is
turned into `RelaxConfig` instances (`relax.config.compose.to_relax_config`).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

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


def _copy_store(self: ConfigStore, memo: dict[int, Any]) -> ConfigStore:
    """A copy of the ConfigStore that shares its stored nodes: the group dicts and the ConfigNode records are new
    (a later `store()` on either does not show in the other, as with a deep copy), the DictConfig nodes are the same
    objects. Hydra deep-copies its config repository on every compose (`CachingConfigRepository`), the store with
    it: every schema node, Relax's and Hydra's own, which was the largest single part of composing a config. A
    stored node is never written in place (`store()` replaces it, `ConfigStore.load` hands out a deep copy of it),
    so sharing it is safe, and `Singleton.get_state()` still gets a store of its own."""
    new = object.__new__(type(self))
    memo[id(self)] = new

    def tree(d: dict[str, Any]) -> dict[str, Any]:
        return {k: tree(v) if isinstance(v, dict) else copy.copy(v) for k, v in d.items()}

    for name, value in vars(self).items():
        setattr(new, name, tree(value) if name == "repo" else copy.deepcopy(value, memo))
    return new


if "__deepcopy__" not in vars(ConfigStore):  # Hydra's own, should a later version define one, is kept
    ConfigStore.__deepcopy__ = _copy_store  # type: ignore[attr-defined]

EPISODE_TOKENS_RESOLVER = "relax.episode_tokens"


def episode_tokens(turns: Any, response: Any, observation: Any, at_least: Any = 0) -> int | None:
    """`${relax.episode_tokens:${rollout.max_turns},${rollout.max_response_len},OBS[,AT_LEAST]}`, a data group's
    `rollout.max_episode_tokens` that follows its turns: `turns` turns of `response` tokens and the `turns - 1`
    observations of at most `observation` tokens between them, or `at_least` where that is more. None (the derived
    default, `relax.config.derive`) where a value is not a positive integer: the rules then name that value."""
    values = (turns, response, observation, at_least)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values) or turns < 1 or response < 1:
        return None
    return max(at_least, turns * response + (turns - 1) * observation)


# registered on import: every composition (relax-train, its dry run and sweep jobs, relax-submit, relax-serve,
# load_config) imports this module before it resolves a config
if not OmegaConf.has_resolver(EPISODE_TOKENS_RESOLVER):
    OmegaConf.register_new_resolver(EPISODE_TOKENS_RESOLVER, episode_tokens)

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


PLUGINS_KEY = "plugins"  # the top-level option (RelaxConfig.plugins) naming the user's modules


class PluginError(ValueError):
    """A module of `plugins` that cannot be imported (or a `plugins=` value that is not a list of module names): the
    message is one line naming the option and the module, for relax-train to print before anything starts."""


_imported: dict[str, ModuleType] = {}


def import_plugins(names: Sequence[str]) -> list[ModuleType]:
    """Import each module of `plugins` (once per process; importing it registers its algorithms and other
    components), in order. Raises PluginError naming the option and the first module that cannot be imported."""
    modules = []
    for name in names:
        if not isinstance(name, str) or not name.strip() or ":" in name or "/" in name:
            raise PluginError(f"{PLUGINS_KEY}: {name!r} is not a Python module name (write {PLUGINS_KEY}=[mypkg.algos]"
                              f", a module importable from PYTHONPATH)")
        if name not in _imported:
            try:
                _imported[name] = importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any failure of the user's import is the user's to read
                where = "" if isinstance(exc, ModuleNotFoundError) else " (raised while importing it)"
                raise PluginError(f"{PLUGINS_KEY}: cannot import module {name!r}: {type(exc).__name__}: {exc}"
                                  f"{where}") from exc
        modules.append(_imported[name])
    return modules


def plugin_conf_dirs(modules: Sequence[ModuleType]) -> list[Path]:
    """The `conf/` directory beside each module (`mypkg/conf` for `mypkg/algos.py` and for the package `mypkg`),
    where it has one: Hydra searches them for config groups (`conf/algorithm/<name>.yaml`) after Relax's own."""
    found: list[Path] = []
    for module in modules:
        file = getattr(module, "__file__", None)
        conf = Path(file).resolve().parent / "conf" if file else None
        if conf is not None and conf.is_dir() and conf not in found:
            found.append(conf)
    return found


def plugins_in_overrides(overrides: Sequence[str]) -> list[str]:
    """The modules a command line's `plugins=[...]` names (every value of a sweep's `plugins=[a],[b]`), read before
    the config is composed: they must be imported first, since they may register the algorithm it selects. Raises
    PluginError for a value that is not a list of names."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    names: list[str] = []
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        if key != PLUGINS_KEY or "=" not in text:
            continue
        try:
            value = OverridesParser.create().parse_override(text).value()
        except Exception as exc:  # noqa: BLE001 - Hydra's grammar error, said in one line
            raise PluginError(f"cannot parse {text!r}: {str(exc).splitlines()[0]}") from None
        values = value.list if isinstance(value, ChoiceSweep) else [value]
        for v in values:
            if not isinstance(v, list):
                raise PluginError(f"{text!r}: {PLUGINS_KEY} is a list of module names: write "
                                  f"{PLUGINS_KEY}=[{v if isinstance(v, str) else 'mypkg.algos'}]")
            names += [n for n in v if n not in names]
    return names


SEARCHPATH_KEY = "hydra.searchpath"

# Hydra's command-line flags that take a value (`--cfg job`, `-cp DIR`; hydra/_internal/utils.py, get_args_parser),
# and `--info`, whose value is optional (one of INFO_CHOICES)
HYDRA_VALUE_FLAGS = ("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                     "--config-dir", "--experimental-rerun")
HYDRA_INFO_FLAGS = ("-i", "--info")
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


_SHELL_SPECIAL = frozenset('"$`\\!')  # what a shell's double quotes do not keep as written


def parses(override: str) -> bool:
    """Whether Hydra's override grammar reads `override`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(override)
    except Exception:  # noqa: BLE001 - Hydra's grammar errors are of several types
        return False
    return True


def quoted_override(key: str, values: Sequence[str]) -> str | None:
    """`key=v1,v2,...` with each value quoted for Hydra's grammar (so that a `=` in it is text, and a sweep's choices
    stay choices), written for a shell (`"train.resume='checkpoints/x/algorithm=rloo-seed1'"`); None where no quote
    character fits the values or Hydra would not read the result."""
    import shlex

    quote = next((q for q in ("'", '"') if not any(q in v for v in values)), None)
    if quote is None:
        return None
    written = f"{key}={','.join(quote + v + quote for v in values)}"
    if not parses(written):
        return None
    return f'"{written}"' if quote == "'" and not _SHELL_SPECIAL & set(written) else shlex.quote(written)


def override_text(key: str, value: object) -> str:
    """`key=value` as a shell's command line gives it to Hydra, for a message to paste: as is where Hydra's grammar
    reads the value as written and a shell keeps it one word as written, else quoted (`quoted_override`), as a sweep
    job's checkpoint directory needs (`"train.resume='checkpoints/x/algorithm=rloo-seed1'"`: Hydra reads an unquoted
    `=` as syntax) and a path holding a space. Unquoted where no quoting can hold the value (both quote marks)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain = f"{key}={value}"
    try:
        if str(OverridesParser.create().parse_override(plain).value()) == str(value) and shlex.quote(plain) == plain:
            return plain
    except Exception:  # noqa: BLE001 - Hydra's grammar errors are of several types
        pass
    return quoted_override(key, [str(value)]) or plain


def override_key(override: str) -> str:
    """The key (or config group) `override` sets or deletes: `train.lr` of `+train.lr=1`, `~train.lr`, `++train.lr=1`;
    `model` of `model=tiny` and `model@x=tiny`."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0].strip()


def override_positions(args: Sequence[str]) -> list[int]:
    """The indices of the overrides among `args` (a command line of Hydra's, its flags included): each argument that
    is neither a flag nor a flag's value (`-cp DIR`'s DIR, `--cfg job`'s job, `--info searchpath`'s searchpath)."""
    found: list[int] = []
    value = False
    for i, arg in enumerate(args):
        if value:
            value = False
            continue
        if arg.startswith("-"):
            value = arg in HYDRA_VALUE_FLAGS or (arg in HYDRA_INFO_FLAGS and i + 1 < len(args)
                                                 and args[i + 1] in INFO_CHOICES)
            continue
        found.append(i)
    return found


def with_override(args: Sequence[str], line: str) -> list[str]:
    """`args` (a command line of Hydra's, its flags included) with the override `line` added among the user's own:
    right after the block of overrides (Hydra's parser takes them as one block: an override after `--cfg job` is an
    "unrecognized argument"), or first where there is none (after a bare `--info` it would be read as its value)."""
    out = list(args)
    positions = override_positions(out)
    if not positions:
        return [line, *out]
    end = positions[0]
    while end + 1 in positions:
        end += 1
    out.insert(end + 1, line)
    return out


def with_search_path(overrides: Sequence[str], dirs: Sequence[Path], *, first: bool = False) -> list[str]:
    """`overrides` with `dirs` added to Hydra's search path (`hydra.searchpath=[...]`, after the entries a user's own
    override lists; `first`: before them, where Hydra puts -cd/--config-dir's), so that Hydra's main and relax-train's
    own check both find the config groups in them. A new override joins the user's (`with_override`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out, entries, at = list(overrides), [], None
    for i, text in enumerate(out):
        if text.split("=", 1)[0] == SEARCHPATH_KEY and "=" in text and i in override_positions(out):
            value = OverridesParser.create().parse_override(text).value()
            entries, at = (list(value) if isinstance(value, list) else [value]), i
    added = [f"file://{d}" for d in dirs]
    entries = ([*added, *(e for e in entries if e not in added)] if first
               else [*entries, *(e for e in added if e not in entries)])
    quoted = ",".join('"' + e + '"' if "'" in e else "'" + e + "'" for e in map(str, entries))
    line = f"{SEARCHPATH_KEY}=[{quoted}]"
    if at is None:
        return with_override(out, line)
    out[at] = line
    return out


def with_plugins(overrides: Sequence[str]) -> list[str]:
    """Import the modules a command line's `plugins=[...]` names (before its config is composed: they may register
    the algorithm it selects) and return `overrides` with their `conf/` directories on Hydra's search path. What
    relax-train does first, and relax-submit before its config check. Raises PluginError (one line) for a module that
    cannot be imported or a value that is not a list of names."""
    dirs = plugin_conf_dirs(import_plugins(plugins_in_overrides(overrides)))
    return with_search_path(overrides, dirs) if dirs else list(overrides)
