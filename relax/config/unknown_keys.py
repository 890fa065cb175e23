"""Keys that the schema lacks: a misspelled field (`train.lrr`), another algorithm's option (`algorithm.kl2_budget`
without algorithm=m2po), a field `+`-added to a section. Each becomes one violation that names the key and what was
meant (the closest fields, or the algorithms whose config has it), reported with every other problem of the config.

Hydra refuses an override of a key a structured config lacks (with its advice to append it with `+`, which the
frozen dataclasses then refuse); `compose_known` leaves such overrides out and names them instead, and
`extra_keys` finds the keys that `+` added. It does the same with a group choice that names no option
(`model=nonexistent`, where Hydra stops at the first with its own message): each is named with the group's options,
and the rest of the command line is still composed, so that its unknown keys are reported with it; with a value
that is not of its key's type (`train.lr=abc`: `relax.config.value_types`); and with an override of a form Hydra
refuses or that would take a key from the schema (`+train.lr=2e-5` of a key that is there, `~train.lr`:
`form_violation`), or that gives a mapping of free keys a new key without `+` (`data.eval_sets={two:...}`,
`data.eval_sets.two=...`: `free_key_message`, naming the `+` form).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from relax import algorithms
from relax.algorithms.base import Violation
from relax.config.schema import RelaxConfig
from relax.config.value_types import mistyped_override, mistyped_violation, type_text


def _fields(node: Any) -> list[str] | None:
    """The field names of the schema dataclass behind `node`, None when it is not one (a free dict, a value)."""
    if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
        return None
    t = OmegaConf.get_type(node)
    return [f.name for f in dataclasses.fields(t)] if dataclasses.is_dataclass(t) else None


def _algorithms_with(field: str) -> list[str]:
    return [n for n in algorithms.names()
            if any(f.name == field for f in dataclasses.fields(algorithms.get(n).config_cls))]


def _in_free_mapping(cfg: DictConfig, key: str) -> bool:
    """Whether `key` (dotted) names a key inside a mapping of free keys of the schema (`data.eval_sets.two`): the
    schema's fields lead to the mapping, as `unknown_key` walks them."""
    node: Any = cfg
    for i, part in enumerate(key.split(".")):
        fields = _fields(node)
        if fields is None:
            return i > 0 and isinstance(node, DictConfig)
        if part not in fields:
            return False
        node = node._get_node(part)
    return False


def _joined(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _has(node: Any, path: Sequence[str]) -> bool:
    """Whether the schema's sections from `node` lead along `path` to a key (a section or a value)."""
    for part in path:
        if part not in (_fields(node) or ()):
            return False
        node = node._get_node(part)
    return True


def _no_section(node: Any, prefix: str, tail: Sequence[str], close: Sequence[str], key: str) -> str:
    """What to say of `key`, whose part `tail[0]` names no section of `node` (at `prefix`) and `tail[1:]` follows it:
    "did you mean" naming only keys the schema has: the rest of the key in a close section (`trian.lr`: train.lr);
    else the rest of the key where `tail[0]` stands (`trainer.seed`: seed); else keys close to `tail[1]` in the close
    sections and here (`trainr.lrr`: train.lr); else the close sections alone (`trainer.foo`: train or tracking)."""
    sections = [c for c in close if _fields(node._get_node(c)) is not None]
    found = [_joined(prefix, c, *tail[1:]) for c in sections if _has(node._get_node(c), tail[1:])]
    if not found and _has(node, tail[1:]):
        found = [_joined(prefix, *tail[1:])]
    if not found:
        for where, at in [*((node._get_node(c), _joined(prefix, c)) for c in sections), (node, prefix)]:
            # closer than difflib's default: the section was a guess already (`trainer.nnodes` is not train.mode)
            found += [_joined(at, m, *tail[2:])
                      for m in difflib.get_close_matches(tail[1], _fields(where) or [], n=2, cutoff=0.75)
                      if _has(where._get_node(m), tail[2:])]
        found = list(dict.fromkeys(found))[:3]
    if found:
        return f"unknown key {key} (did you mean {' or '.join(found)}?)"
    where = f"{prefix} has no section {tail[0]!r}" if prefix else f"no section {tail[0]!r}"
    hint = f" (did you mean {' or '.join(_joined(prefix, c) for c in sections)}?)" if sections else ""
    return f"unknown key {key}: {where}{hint}"


# verl's names of what Relax names otherwise (verl's trainer config: ppo_trainer.yaml), where one Relax key does the
# same: (the key's last parts, what to say). Checked on a key the schema lacks, whatever section it is given in
# (`trainer.total_epochs`, `actor_rollout_ref.actor.clip_ratio`), before the close matches, which would name unrelated
# keys; a name that says what it is only with its section (`rollout.n`, `trainer.save_freq`) is matched with it. An
# epoch: `relax.data.datasets.PromptSampler` draws rollout.rollout_batch_size prompts per rollout and goes on into the
# next epoch's order, so an epoch is (prompts) / rollout_batch_size rollouts.
VERL_NAMES: tuple[tuple[str, str], ...] = (
    ("total_epochs", "verl's total_epochs: Relax counts rollouts, not epochs: set train.num_rollout, the number of "
                     "training steps; an epoch is the number of prompts / rollout.rollout_batch_size rollouts"),
    ("total_training_steps", "verl's total_training_steps is train.num_rollout here: one rollout is one training step"),
    ("train_batch_size", "verl's data.train_batch_size, prompts per training step, is rollout.rollout_batch_size here"),
    ("ppo_mini_batch_size", "verl's ppo_mini_batch_size counts prompts, train.global_batch_size counts the responses "
                            "of an optimizer step: set it to ppo_mini_batch_size x rollout.n_samples_per_prompt"),
    ("clip_ratio", "verl's clip_ratio is algorithm.eps_clip here"),
    ("clip_ratio_low", "verl's clip_ratio_low is algorithm.eps_clip here"),
    ("clip_ratio_high", "verl's clip_ratio_high is algorithm.eps_clip_high here"),
    ("rollout.n", "verl's rollout.n is rollout.n_samples_per_prompt here"),
    ("entropy_coeff", "verl's entropy_coeff is algorithm.entropy_coef here"),
    ("max_prompt_length", "verl's data.max_prompt_length is rollout.max_prompt_len here, in tokens too"),
    ("max_response_length", "verl's data.max_response_length is rollout.max_response_len here, in tokens too"),
    ("actor.optim.lr", "verl's actor.optim.lr is train.lr here"),
    ("trainer.save_freq", "verl's trainer.save_freq, a checkpoint every N steps, is train.save_interval here: 0 saves "
                          "only at the end, train.save=false never"),
    ("trainer.test_freq", "verl's trainer.test_freq, an evaluation every N steps, is train.eval_interval here"),
    ("trainer.project_name", "verl's trainer.project_name is tracking.experiment here, the MLflow experiment"),
    ("trainer.experiment_name", "verl's trainer.experiment_name is tracking.run_name here, the MLflow run's name"),
)


def verl_hint(key: str) -> str | None:
    """What `VERL_NAMES` says of `key` (dotted, a key the schema lacks) when it ends with one of verl's names."""
    return next((text for name, text in VERL_NAMES if key == name or key.endswith("." + name)), None)


def unknown_key(cfg: DictConfig, key: str, override: str = "") -> Violation:
    """The violation of `key` (dotted), a key the schema of the composed `cfg` lacks; `override`: the user's text
    that set it, where one did (named in the `+` form to type, for a new key of a free mapping)."""
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        fields = _fields(node)
        if fields is None:  # a free-form section: its keys are not checked
            if i > 0 and isinstance(node, DictConfig):  # Hydra refused the key: a new one, given without +
                return Violation((key,), free_key_message(".".join(parts[:i]), part, new_key_override=override))
            break
        # Hydra's own node, where the config was composed with it (`load_config(hydra=True)`, `hydra_problems`)
        if part in fields or (i == 0 and part == "hydra" and part in node):
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
        verl = verl_hint(key)
        if verl is not None:
            return Violation((key,), f"unknown key {key} ({verl})")
        close = difflib.get_close_matches(part, fields, n=3)
        if i + 1 < len(parts):  # a section the schema lacks (`trian.lr`, `trainer.seed`)
            return Violation((key,), _no_section(node, prefix, parts[i:], close, key))
        hint = f" (did you mean {' or '.join(_joined(prefix, c) for c in close)}?)"
        where = f"{prefix} has no key {part!r}" if prefix else "no such section or key"
        return Violation((key,), f"unknown key {key}{hint}" if close else f"unknown key {key}: {where}")
    # a key of the schema that the composed YAML lacks: a config of its own (`-cp <dir> -cn config`, a run's saved
    # config, plain YAML) holds only the keys it was saved with (`algorithm.kl2_budget` after algorithm.name=m2po on
    # a grpo run's), and Hydra sets a key a config lacks only with +
    return Violation((key,), f"unknown key {key}: the config file (-cp/-cn) has no such key, though the schema has "
                             f"it: add it with +{override.lstrip('+') if override else key + '=...'}")


def free_key_message(mapping: str, name: str = "", override: str = "", new_key_override: str = "") -> str:
    """What to say of keys given to the free mapping `mapping` (`data.eval_sets`, a `dict[str, Any]` field) without
    `+`: the key `mapping.name` set alone (`data.eval_sets.two=...`, Hydra's 'unknown key'), or a value `override`
    with keys the mapping lacks (`data.eval_sets={two:...}`, Hydra's 'Key 'two' is not in struct'). A mapping's keys
    are the user's (no schema names them) and Hydra adds them only with `+`, the form the docs give
    (docs/training.md, "Eval sets"). `new_key_override`: the override that set `mapping.name` alone
    (`data.eval_sets.two=/x.jsonl`), given back with `+` in front: the exact text to type."""
    what = (f"{mapping} is a mapping of keys of your own (empty unless a config gives it some), and Hydra adds a "
            "key to it only with +")
    if override:
        return f"{override}: {what}: '+{override}'"
    if new_key_override:
        return f"unknown key {mapping}.{name}: {what}: '+{new_key_override}'"
    return f"unknown key {mapping}.{name}: {what}: '+{mapping}={{{name}:...}}' (or +{mapping}.{name}=...)"


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


def _new_mapping_key(exc: BaseException, overrides: Sequence[str]) -> int | None:
    """The index of an override without `+` that gave a free mapping (`data.eval_sets={two:...}`) a value with a
    key it does not have, which Hydra refused ('Key 'two' is not in struct'), else None."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__ or exc.__context__
    full_key = getattr(cause, "full_key", None)
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or not full_key:
        return None
    for i, o in enumerate(overrides):
        key, eq, value = o.partition("=")
        if eq and not key.startswith(("+", "~")) and full_key.startswith(key + ".") and value.lstrip().startswith("{"):
            return i
    return None


def _missing_choice(exc: BaseException, overrides: Sequence[str]) -> tuple[int, Violation] | None:
    """(the index of the override, its violation) when Hydra refused a group choice that names no option of its
    group (`model=nonexistent`: Hydra's MissingConfigException for `model/nonexistent`), else None."""
    from hydra.errors import MissingConfigException

    missing = getattr(exc, "missing_cfg_file", None) if isinstance(exc, MissingConfigException) else None
    if not missing or "/" not in missing:
        return None
    group, _, value = missing.rpartition("/")
    for i, o in enumerate(overrides):
        key, eq, choice = o.partition("=")
        if eq and key.lstrip("+~").split("@", 1)[0] == group and choice.strip("'\"") == value:
            options = [n for n in (getattr(exc, "options", None) or ()) if not n.endswith("_schema")]
            close = difflib.get_close_matches(value, options, n=1)
            hint = f" (did you mean {group}={close[0]}?)" if close else ""
            if not close and group == "algorithm":  # registered by a module Hydra has not seen: plugins= imports it
                hint = " (an algorithm a plugin registers: give plugins=[its module] on the command line)"
            return i, Violation((group,), f"{group}={value}: config group {group} has no option {value!r}{hint}; "
                                          f"its options: {', '.join(options)}")
    return None


# Hydra's refusals of an override's form (hydra._internal.config_loader_impl._apply_overrides_to_config)
_APPEND = re.compile(r"Could not append to config\. An item is already at '(.+)'\.")
_DELETE = re.compile(r"Could not delete from config\. (?:'(.+)' does not exist|The value of '(.+?)' is .*)\.")
_MERGING = "Error merging override "


def _misformed_override(exc: BaseException, overrides: Sequence[str]) -> int | None:
    """The index of the override that Hydra refused for its form, else None: `+key=value` (which adds a key) of a
    key the config has; `~key` (which deletes one) of a key the config lacks or holds null, or with a value other
    than the key's (`~key=value`), or of a field of a schema section (which OmegaConf refuses to delete)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    append, delete = _APPEND.match(first), _DELETE.match(first)
    for i, o in enumerate(overrides):
        key = o.split("=", 1)[0]
        if append and o.startswith("+") and not o.startswith("++") and key[1:] == append.group(1):
            return i
        if o.startswith("~") and (first == f"{_MERGING}{o}" or (delete and key[1:] in delete.groups())):
            return i
    return None


def _deleted_field(dc: DictConfig, overrides: Sequence[str]) -> int | None:
    """The index of a `~key` override that deleted a field of the schema's root (`~train`, `~seed`), else None:
    Hydra deletes with the root open, so nothing refuses it, and building the config would put the schema's default
    in its place. (A group's default deleted, `~teacher`, leaves the schema's node: not this.) A config of its own
    (a plain YAML, `-cp <dir> -cn <name>`) is built on the same schema: its root's fields are RelaxConfig's."""
    fields = _fields(dc)
    if fields is None:
        fields = [f.name for f in dataclasses.fields(RelaxConfig)]
    for i, o in enumerate(overrides):
        key = o[1:].split("=", 1)[0]
        if o.startswith("~") and key in fields and key not in dc:
            return i
    return None


def _deleted_schema_key(named: DictConfig, overrides: Sequence[str]) -> int | None:
    """The index of a `~key` override of a key the schema has (`~train.lr`), which Hydra deleted from a config of its
    own (a plain YAML: nothing refuses it there, and the schema's default would take its place), else None; `named`:
    the config as the schema's (`relax.config.compose.schema_view`). A key of a mapping of free keys is the user's
    to delete."""
    for i, o in enumerate(overrides):
        if not o.startswith("~"):
            continue
        parent_key, _, leaf = o[1:].split("=", 1)[0].rpartition(".")
        parent = OmegaConf.select(named, parent_key, default=None) if parent_key else named
        if leaf in (_fields(parent) or ()):
            return i
    return None


def _into_a_value(override: str) -> tuple[str, Any] | None:
    """(the key, its declared type) of the schema's value that `override` sets a key inside (`model.path.x=1`,
    `rollout.sglang.extra_args.foo=1`), read off the schema's dataclasses, else None. Hydra and OmegaConf refuse such
    an override in their own words or with an AssertionError; the algorithm's section (its class is the choice's) and
    Hydra's config are left to them, as is a key inside a mapping of free keys."""
    if override.startswith("~"):
        return None
    parts = override.lstrip("+").split("=", 1)[0].split(".")
    if parts[0] in ("algorithm", "hydra") or "[" in parts[-1]:
        return None
    node: Any = RelaxConfig
    for i, part in enumerate(parts[:-1]):
        if not dataclasses.is_dataclass(node):
            return None
        try:
            declared = typing.get_type_hints(node).get(part)
        except (NameError, TypeError):  # an annotation this check cannot read: left to Hydra
            return None
        if declared is None:
            return None  # a key the schema lacks: unknown_key names it
        inner = [a for a in typing.get_args(declared) if a is not type(None)] \
            if typing.get_origin(declared) is typing.Union else [declared]
        section = inner[0] if len(inner) == 1 else Any
        if dataclasses.is_dataclass(section):
            node = section
            continue
        if section is Any or section is dict or typing.get_origin(section) is dict:
            return None  # a mapping of free keys
        return ".".join(parts[:i + 1]), declared
    return None


def _written(value: Any) -> str:
    """`value` as an override writes it (null, true, 1e-05, text)."""
    if value is None or isinstance(value, bool):
        return str(value).lower() if value is not None else "null"
    return str(value)


def form_violation(dc: DictConfig, override: str) -> Violation:
    """The violation of `override`, which `_misformed_override`, `_new_mapping_key` or `_deleted_field` found, named
    against `dc`, the config composed without it: what it would do, and what to write instead."""
    key, _, value = override.lstrip("+~").partition("=")
    inside = _into_a_value(override)
    if inside is not None:
        return Violation((inside[0],), f"{override}: {inside[0]} takes {type_text(inside[1])}, a value without keys of "
                                       f"its own: set it with {inside[0]}=VALUE")
    if not override.startswith(("+", "~")):  # a mapping given keys it lacks, without +
        if _in_free_mapping(dc, key):  # one key of it set alone (`data.eval_sets.two=...`, `compose_known`)
            return unknown_key(dc, key, override=override)
        return Violation((key,), free_key_message(key, override=override))  # its value (`_new_mapping_key`)
    if override.startswith("+"):
        return Violation((key,), f"{override}: {key} is already in the config, and + adds a key it does not have: "
                                 f"set it with {key}={value} (++{key}={value} sets it whether or not it is there)")
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(dc, parent_key, default=None) if parent_key else dc
    current = OmegaConf.select(dc, key, default=None, throw_on_missing=False)
    if leaf in (_fields(parent) or ()):  # a field of the schema (Relax's, or Hydra's own): every config has it
        # `~hydra.job.chdir` deletes a key of Hydra's config, not of Relax's schema: named as whose it is
        owner = "Hydra's config" if key.split(".", 1)[0] == "hydra" else "the schema"
        if isinstance(current, DictConfig):
            return Violation((key,), f"{override}: {key} is a section of {owner} (every config has it), so "
                                     f"it cannot be deleted: to keep the values the config gives it, leave {override} "
                                     f"out; to change one: {key}.KEY=VALUE")
        return Violation((key,), f"{override}: {key} is a key of {owner} (every config has it), so it cannot "
                                 f"be deleted: to keep the value the config gives it ({key}={_written(current)}), "
                                 f"leave {override} out; to change it: {key}=VALUE")
    if current is None:
        found = unknown_key(dc, key)
        return Violation(found.fields, f"{override}: nothing to delete: {found.message}")
    return Violation((key,), f"{override}: {key} is {_written(current)}, not {value}: nothing to delete (~{key} "
                             "deletes it whatever its value)")


def compose_known(compose: Any, overrides: Sequence[str],
                  named: Callable[[DictConfig, Sequence[str]], DictConfig] | None = None
                  ) -> tuple[DictConfig, list[str], list[Violation], list[Violation]]:
    """`compose(overrides)`, leaving out each override whose key the schema lacks, each group choice that names
    no option, each value that is not of its key's type and each override of a form Hydra refuses or that would
    delete a field of the schema (`form_violation`): (config, the keys left out, a violation per choice left out, a
    violation per value or form left out: `relax.config.value_types`, `form_violation`). With a choice left out the
    config is composed with the group's default instead, with a value or form left out with the key's value: only
    for the other overrides' keys to be checked. `named(config, overrides)`: the config composed as the schema's,
    for a config Hydra composes untyped (a config of its own, `-cp <dir> -cn <name>`:
    `relax.config.compose.schema_view`): each problem is named against it as on Relax's config, and a `~key` of a key
    the schema has, which Hydra deletes from such a config, is refused as Relax's refuses it."""
    from hydra.errors import ConfigCompositionException, HydraException
    from omegaconf.errors import OmegaConfBaseException

    kept, dropped, choices, mistyped, misformed = list(overrides), [], [], [], []
    dropped_by: list[str] = []  # the overrides of the keys in `dropped`
    # a key set inside a value (`model.path.x=1`): OmegaConf's own words, or an AssertionError, if composed
    misformed += [o for o in kept if _into_a_value(o) is not None]
    kept = [o for o in kept if o not in misformed]
    # a field of the root deleted (`~train`) changes how every later override of its keys composes: those first,
    # composed alone (each a key's deletion or a group's default's, which leaves the schema's node: `_deleted_field`)
    roots = [o for o in kept if o.startswith("~") and "." not in o.split("=", 1)[0]]
    if roots:
        try:
            alone = compose(roots)
        except (HydraException, OmegaConfBaseException):
            alone = None  # refused for another reason: found below
        while alone is not None and (i := _deleted_field(alone, kept)) is not None:
            misformed.append(kept.pop(i))
    while True:
        try:
            dc = compose(kept)
            i = _deleted_field(dc, kept)
            typed = dc if named is None or i is not None else named(dc, kept)
            if i is None and typed is not dc:
                i = _deleted_schema_key(typed, kept)
            if i is not None:
                misformed.append(kept.pop(i))
                continue
            # a new key of a free mapping set alone, without + (`data.eval_sets.two=...`): named with the user's own
            # override, `+` in front, the text to type (Hydra's config's mappings: `unknown_hydra_key`)
            for o in [o for o in dropped_by if not o.startswith(("+", "~", "hydra."))
                      and _in_free_mapping(typed, o.split("=", 1)[0])]:
                dropped.remove(o.split("=", 1)[0])
                misformed.append(o)
            return dc, dropped, choices, [*(mistyped_violation(typed, o, exc) for o, exc in mistyped),
                                          *(form_violation(typed, o) for o in sorted(misformed, key=overrides.index))]
        except ConfigCompositionException as exc:
            i = _misformed_override(exc, kept)
            if i is None:
                i = _new_mapping_key(exc, kept)
            if i is not None:
                misformed.append(kept.pop(i))
                continue
            missing = _missing_choice(exc, kept)
            if missing is not None:
                choices.append(missing[1])
                kept.pop(missing[0])
                continue
            i = mistyped_override(exc, kept)
            if i is not None:
                mistyped.append((kept.pop(i), exc))
                continue
            i = _unknown_override(exc, kept)
            if i is None:
                raise
            dropped_by.append(kept.pop(i))
            dropped.append(dropped_by[-1].split("=", 1)[0].lstrip("+~"))


def unknown_hydra_key(dc: DictConfig, key: str) -> Violation:
    """`key` (`hydra.<...>`), which Hydra's config in `dc` (composed with it) lacks: with the close ones, or, in a
    mapping of free keys (`hydra.job.env_set`), how to add it (`+key=...`), as Hydra's own refusal says."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(dc, parent_key, default=None)
    if isinstance(parent, DictConfig) and not dataclasses.is_dataclass(OmegaConf.get_type(parent)):
        return Violation((key,), f"unknown key {key}: {parent_key} has no key {leaf!r} to set; add it with "
                                 f"+{key}=...")
    return unknown_key(dc, key)


def is_hydras(key: str) -> bool:
    """Whether `key` (a violation's first field, a key or a group) is one of Hydra's own (`hydra.job.chdir`,
    `hydra/job_logging`)."""
    return key.startswith(("hydra.", "hydra/"))


def hydra_problems(dc: DictConfig, dropped: Sequence[str], choices: Sequence[Violation],
                   mistyped: Sequence[Violation]) -> list[Violation]:
    """Of `compose_known`'s findings for a config composed with Hydra's own (`return_hydra_config`), those of
    Hydra's keys and groups: a choice of one of its groups that names no option (`hydra/job_logging=bogus`), a value
    not of its key's type or a form refused (`hydra.job.chdir=abc`), a key its config lacks (`hydra.job.chdirr`)."""
    return [*(v for v in [*choices, *mistyped] if is_hydras(v.fields[0])),
            *(unknown_hydra_key(dc, k) for k in dropped if is_hydras(k))]


def choice_problems(dc: DictConfig, dropped: Sequence[str], choices: Sequence[Violation],
                    mistyped: Sequence[Violation] = ()) -> list[Violation]:
    """What a command line with group choices that name no option (`choices`, from `compose_known`) gets reported:
    those, then its values not of their key's type (`mistyped`), then its unknown keys (`dropped` and the `+`-added
    ones); not the rules, which would judge the groups' defaults in their place. A key of `algorithm.` is left out
    when the algorithm choice was: which keys an algorithm has, and their types, depend on the algorithm."""
    bad = {v.fields[0] for v in choices}

    def judged(key: str) -> bool:
        return not ("algorithm" in bad and key.startswith("algorithm."))

    keys = [k for k in [*dropped, *extra_keys(dc)] if judged(k)]
    return [*choices, *(v for v in mistyped if judged(v.fields[0])), *(unknown_key(dc, k) for k in keys)]
