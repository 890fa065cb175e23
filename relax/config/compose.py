"""From Hydra's composed DictConfig to one frozen, resolved and validated `RelaxConfig`."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException, ValidationError

from relax import algorithms
from relax.algorithms.base import Violation
from relax.config.derive import resolve
from relax.config.schema import RelaxConfig, TrainConfig
from relax.config.store import PLUGINS_KEY, PluginError, import_plugins, register_configs, writable_node
from relax.config.unknown_keys import (
    choice_problems,
    compose_known,
    drop_extra_keys,
    extra_keys,
    hydra_problems,
    is_hydras,
    unknown_key,
)
from relax.config.validate import ConfigError, check, validate
from relax.config.value_types import about, field_key, type_violation

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def conf_dir() -> Path:
    """The `conf/` directory of this checkout (Relax is installed editable: `pip install -e .`)."""
    if not (CONF_DIR / "config.yaml").is_file():
        raise FileNotFoundError(f"Relax's config directory {CONF_DIR} is missing; "
                                "install Relax with `pip install -e .`")
    return CONF_DIR


# what a run writes: in a reused run's saved config, the run's; an evaluation-only run of it writes none of it
RUN_SAVING_FIELDS = ("save_interval", "keep_checkpoints", "save_hf")


def to_relax_config(dc: DictConfig, unknown: Sequence[Violation] = (),
                    overrides: Optional[Sequence[str]] = None, left_out: Sequence[str] = (), *,
                    note: bool = True, saved: Optional[tuple[DictConfig, list[Violation]]] = None) -> RelaxConfig:
    """Instantiate the frozen dataclasses, derive the None fields, validate (raises ConfigError). A key the schema
    lacks (`+train.foo=1`; `unknown`: those `compose_known` left out) is a violation, reported with all the others.
    `overrides`: the command line's (Hydra's syntax), where the caller has them: with a run's saved config as the
    primary config and train.num_rollout=0, the run's saving options that they do not set (`RUN_SAVING_FIELDS`)
    are put back to their defaults, with a note (`_evaluation_writes_nothing`), and, whatever the run, the sweep it
    names that they do not set (`_no_sweep_of_its_own`); None: every value counts as set.
    `left_out`: keys whose given value was refused (not of its type, among `unknown`) and so hold their defaults:
    the rules' verdicts on them are not reported, as they would judge a value nobody gave. `note=False`: the note on
    a reused run's saving options is not printed (a check before the run, which prints it). `saved`: for a config of
    its own, its `saved_config` (with the keys `overrides` add) where the caller has made it already (`load_config`),
    not made again."""
    found = list(unknown)
    typed: Optional[set[str]] = None
    try:  # the user's modules (relax-train imported those of its command line already): they may register the saved
        # config's algorithm, and an unimportable one is refused here, before anything starts
        import_plugins(list(dc.get(PLUGINS_KEY) or ()))
    except PluginError as exc:
        raise ConfigError([Violation((PLUGINS_KEY,), str(exc))]) from None
    if OmegaConf.get_type(dc) is not RelaxConfig:  # `-cn` named a YAML file of its own (`-cp <dir> -cn <name>`)
        dc, mistyped = saved if saved is not None else saved_config(dc, added_keys(overrides or ()))
        found = [*mistyped, *found]  # values not of their key's type first, as a composed config's (`compose_known`)
        left_out = [*left_out, *(v.fields[0] for v in mistyped)]
        if overrides is not None:
            typed = override_keys(overrides)
    if extra_keys(dc):
        dc = dc.copy()
        found += drop_extra_keys(dc)
    obj = OmegaConf.to_object(dc)
    if not isinstance(obj, RelaxConfig):
        raise TypeError(f"composed config is {type(obj).__name__}, expected RelaxConfig")
    if typed is not None:
        obj = _evaluation_writes_nothing(obj, typed, note=note)
        obj = _no_sweep_of_its_own(obj, typed, note=note)
    if not found:
        return check(resolve(obj), given=obj)
    cfg = resolve(obj)
    rules = [v for v in validate(cfg, given=obj) if not about(v, left_out)]
    raise ConfigError(found + rules, cfg.algorithm.name)


def _evaluation_writes_nothing(cfg: RelaxConfig, typed: set[str], *, note: bool = True) -> RelaxConfig:
    """`cfg`, a reused run's saved config with the command line's overrides (which set the keys `typed`), as an
    evaluation-only run (train.num_rollout=0) of it: the run's saving options the command line did not set are put
    back to their defaults, and a note on stderr names them. They say what the training run wrote; this run trains
    nothing and writes no checkpoint, and its options are checked as any run's (one set on the command line is
    refused as having no effect: validate). Unchanged for any other run."""
    if cfg.train.num_rollout != 0:
        return cfg
    default = TrainConfig()
    reset = {k: getattr(default, k) for k in RUN_SAVING_FIELDS
             if f"train.{k}" not in typed and getattr(cfg.train, k) != getattr(default, k)}
    if not reset:
        return cfg
    was = ", ".join(f"train.{k}={getattr(cfg.train, k)}" for k in reset)
    if note:
        print(f"relax-train: note: evaluation only (train.num_rollout=0) writes no checkpoint and exports nothing: the "
              f"saved config's {was} (the training run's) do not apply to it", file=sys.stderr)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **reset))


# which sweep a run is of: in a reused run's saved config, the sweep that ran it (its launcher's overrides); a run
# is of the sweep whose launcher sets them on its own command line, as each job's (tracking_overrides), or of none
RUN_SWEEP_FIELDS = ("sweep_id", "parent_run_id")


def _no_sweep_of_its_own(cfg: RelaxConfig, typed: set[str], *, note: bool = True) -> RelaxConfig:
    """`cfg`, a reused run's saved config with the command line's overrides (which set the keys `typed`): the
    sweep the saved config names (`tracking.sweep_id`, `tracking.parent_run_id`: the one whose launcher ran the
    training run, or the job that last saved it) is not this run's unless its command line sets it, as a sweep
    launcher does for each of its jobs. So a run started without `-m` is of no sweep: a run it reopens
    (`train.resume`) keeps the sweep and parent it has (docs/training.md, "MLflow across a resume"), a new run
    joins no sweep; a job of a sweep joins its own (the launcher's overrides). A note on stderr names what is put
    back. `tracking.arm` stays: a resume may not change it, and it named the run's save directory."""
    reset = {k: None for k in RUN_SWEEP_FIELDS if f"tracking.{k}" not in typed and getattr(cfg.tracking, k)}
    if not reset:
        return cfg
    was = ", ".join(f"tracking.{k}={getattr(cfg.tracking, k)}" for k in reset)
    if note:
        print(f"relax-train: note: the saved config's {was} (the sweep that ran it) do not apply to this run, which "
              "no sweep launched: a run it reopens keeps its own sweep and parent run, a new run joins no sweep",
              file=sys.stderr)
    return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, **reset))


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys that Hydra overrides set, add or delete (`train.save_hf=true`, `+a.b=1`, `~a.b`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}


def added_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys that `+`/`++` overrides add (`+train.foo=1`): the only keys a command line can put into a
    config of its own that its YAML file lacks (Hydra refuses the others)."""
    return {o.split("=", 1)[0].lstrip("+") for o in overrides if o.startswith("+")}


# the sections every saved Relax config holds (a checkpoint's config.yaml, the MLflow run's config.yaml artifact)
SAVED_CONFIG_SECTIONS = ("algorithm", "model", "rollout", "train", "data")
OWN_CONFIG_HINT = ("relax-train composes its own conf/config.yaml: a run's saved config (a checkpoint's config.yaml "
                   "or the MLflow run's config.yaml artifact) is reused whole with `relax-train -cp <its directory> "
                   "-cn config ...`; any other YAML goes in an experiment file, `# @package _global_` on its first "
                   "line: `relax-train --config-dir <dir> +experiment=<name> ...` (docs/experiments.md)")


def saved_config(dc: DictConfig, added: Collection[str] = ()) -> tuple[DictConfig, list[Violation]]:
    """`dc`, a config Hydra composed from a YAML file other than Relax's (`-cp <dir> -cn <name>`), as the schema's:
    a run's saved config (every section of `SAVED_CONFIG_SECTIONS`) merged onto the schema's defaults, so that its
    values are type-checked and validated as a composed config's are; anything else is a ConfigError saying what
    relax-train takes (never a traceback). Also a violation per value not of its key's type (the saved config's or
    the command line's, which Hydra merged into it untyped), each left at the schema's default (so that the rest is
    checked), named as `relax.config.value_types` names a composed config's. `added`: the keys the command line
    added (`added_keys`): one the schema lacks is kept in the node returned, where `extra_keys` finds it, to be named
    as an unknown key as on Relax's config (`+train.lrr=1`: did you mean train.lr?); one of the file itself (a config
    saved by another version) is a ConfigError saying so. The modules of its own `plugins:` are imported before its
    algorithm is looked up (one that cannot be: a ConfigError naming `plugins`, as `to_relax_config`'s)."""
    plain = OmegaConf.to_container(dc, resolve=False)
    if not isinstance(plain, dict):
        raise ConfigError([Violation(("config",), f"the config file is not a mapping. {OWN_CONFIG_HINT}")])
    plain.pop("hydra", None)
    missing = [s for s in SAVED_CONFIG_SECTIONS if not isinstance(plain.get(s), dict)]
    if missing:
        raise ConfigError([Violation(("config",), f"the config file (-cn/--config-name) is not a Relax config: it has "
                                                  f"no {', '.join(missing)} section{'s' if len(missing) > 1 else ''}. "
                                                  f"{OWN_CONFIG_HINT}")])
    plugins = plain.get(PLUGINS_KEY)
    if isinstance(plugins, list):  # the file's own modules first, as the run imports them (`to_relax_config`): a
        # saved config of a plugin's algorithm names the module that registers it (a value of another type is refused
        # by the merge below, as a value not of its key's type)
        try:
            import_plugins(plugins)
        except PluginError as exc:
            raise ConfigError([Violation((PLUGINS_KEY,), str(exc))]) from None
    name = plain["algorithm"].get("name")
    if name not in algorithms.names():
        raise ConfigError([Violation(("algorithm.name",), f"the saved config's algorithm.name={name!r} is not one of "
                                                          f"{', '.join(algorithms.names())}")])
    # the schema's nodes, writable as Hydra's are (relax.config.store), the algorithm's of its own class
    base = writable_node(RelaxConfig)
    base.algorithm = writable_node(algorithms.get(name).config_cls)
    mistyped: list[Violation] = []
    unknown: dict[str, object] = {}  # the command line's keys the schema lacks, put back after the merge
    while True:
        try:
            merged = OmegaConf.merge(base, plain)
            if unknown:
                with open_dict(merged):
                    for key, value in unknown.items():
                        OmegaConf.update(merged, key, value, force_add=True)
            return merged, mistyped
        except ValidationError as exc:  # a value not of its key's type: named, left out, the rest merged again
            key = field_key(str(getattr(exc, "full_key", "") or ""))
            value = _pop(plain, key) if key else _MISSING
            if value is _MISSING:
                raise _does_not_fit(exc) from None
            mistyped.append(type_violation(base, key, _as_written(value), exc))
        except OmegaConfBaseException as exc:  # a key the schema lacks: the command line's, or the file's (a config
            # saved by another version)
            key = str(getattr(exc, "full_key", "") or "")
            if key and any(a == key or a.startswith(key + ".") or key.startswith(a + ".") for a in added):
                value = _pop(plain, key)
                if value is not _MISSING:
                    unknown[key] = value
                    continue
            raise _does_not_fit(exc) from None


_MISSING = object()


def _pop(plain: dict, key: str) -> object:
    """Remove dotted `key` from the nested dict `plain`: its value, `_MISSING` where it holds none."""
    *parents, leaf = key.split(".")
    node: object = plain
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return node.pop(leaf, _MISSING) if isinstance(node, dict) else _MISSING


def _as_written(value: object) -> str:
    """A value as a command line writes it (`abc`, `1.5`, `[1,a]`, `null`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_as_written(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_as_written(v)}" for k, v in value.items()) + "}"
    return str(value)


def _does_not_fit(exc: OmegaConfBaseException) -> ConfigError:
    key = getattr(exc, "full_key", None)
    why = str(exc).splitlines()[0] + (f" (key {key})" if key else "")
    return ConfigError([Violation((key or "config",), f"the saved config does not fit this version's schema: {why}")])


def compose(overrides: Sequence[str] = (), config_name: str = "config", conf: Path | None = None, *,
            hydra: bool = False) -> DictConfig:
    """Compose `conf/config.yaml` (of `conf`, default this checkout's) with overrides, as `relax-train` does (for
    tests and notebooks). `hydra`: with Hydra's own config under `hydra` (the launcher's options among them), as
    Hydra's main composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf or conf_dir()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra)


def schema_view(dc: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """`dc`, composed by Hydra, as the schema's, to name what is wrong with it against: itself where Hydra composed it
    from Relax's conf (the schema's nodes); for a config of its own (`-cp <dir> -cn <name>`, a plain YAML that Hydra
    does not type) `saved_config`'s node, with the keys `overrides` add (`added_keys`) and Hydra's own node, where it
    was composed with it (raises ConfigError where it is not a Relax config)."""
    return _schema_view(dc, overrides)[0]


def _schema_view(dc: DictConfig, overrides: Sequence[str]) -> tuple[DictConfig, list[Violation]]:
    """`schema_view`, and the violations of a config of its own's values not of their key's type (`saved_config`'s;
    none for Relax's config)."""
    if OmegaConf.get_type(dc) is RelaxConfig:
        return dc, []
    typed, mistyped = saved_config(dc, added_keys(overrides))
    if "hydra" in dc:
        with open_dict(typed):
            typed["hydra"] = dc.hydra
    return typed, mistyped


def _composed(overrides: Sequence[str], conf: Path | None, hydra: bool, config_name: str = "config"
              ) -> tuple[DictConfig, DictConfig, list[str], list[Violation], list[Violation], list[Violation],
                         list[Violation]]:
    """`compose_known` of `overrides`: (the config, without Hydra's node; the config as the schema's, what its
    problems are named against (`schema_view`); the keys left out, the choices and the values or forms refused,
    each of the config's own; the problems of Hydra's keys and groups, `hydra`: composed with Hydra's config, so
    that its overrides are checked in the same composition; last, a config of its own's values not of their key's
    type, `saved_config`'s, none for Relax's). `config_name`: the primary config, `conf`'s config.yaml or a config of
    its own (`-cp <dir> -cn <name>`), composed as relax-train composes it. A config of its own is read as the
    schema's once (`saved_config`: the view `compose_known` names its problems against is the one returned)."""
    last: list[tuple[DictConfig, DictConfig, list[Violation]]] = []

    def view(composed: DictConfig, kept: Sequence[str]) -> DictConfig:
        typed, own = _schema_view(composed, kept)
        last[:] = [(composed, typed, own)]
        return typed

    dc, dropped, choices, mistyped = compose_known(
        lambda kept: compose(kept, config_name=config_name, conf=conf, hydra=hydra), overrides, named=view)
    # compose_known views the config it returns, with the overrides it kept: those left out put no key into it, so
    # the view is the one of every override (`added_keys` only lets the command line's keys through)
    named, own = (last[0][1], last[0][2]) if last and last[0][0] is dc else _schema_view(dc, overrides)
    if not hydra:
        return dc, named, dropped, choices, mistyped, [], own
    found = hydra_problems(named, dropped, choices, mistyped)
    for node in {id(dc): dc, id(named): named}.values():
        with open_dict(node):  # as Hydra's main gives its task the config
            del node["hydra"]
    return (dc, named, [k for k in dropped if not is_hydras(k)], [v for v in choices if not is_hydras(v.fields[0])],
            [v for v in mistyped if not is_hydras(v.fields[0])], found, own)


def compose_checked(overrides: Sequence[str] = (), conf: Path | None = None, *, hydra: bool = False,
                    config_name: str = "config") -> tuple[DictConfig, list[Violation]]:
    """compose, with each override of a key the schema lacks left out: (config, a violation per unknown key, those
    left out and those `+` added, each naming what was probably meant, and per value not of its key's type; and
    first a violation per group choice that names no option, `compose_known`). `hydra`: composed with Hydra's own
    config, whose overrides' problems come first (the config returned is without it). `config_name`: as
    `load_config`'s (a config of its own: returned as the schema's, `schema_view`)."""
    dc, named, dropped, choices, mistyped, found, own = _composed(overrides, conf, hydra, config_name)
    if named is not dc:  # a config of its own: its values not of their key's type (the file's too), as `saved_config`
        mistyped = [*own, *mistyped]
    if choices:
        return named, [*found, *choice_problems(named, dropped, choices, mistyped)]
    return named, [*found, *mistyped, *(unknown_key(named, key) for key in [*dropped, *extra_keys(named)])]


def load_config(overrides: Sequence[str] = (), conf: Path | None = None, *, hydra: bool = False,
                config_name: str = "config") -> RelaxConfig:
    """compose + to_relax_config: the frozen, validated config of `relax-train <overrides>` (raises ConfigError with
    every problem, unknown keys and values not of their key's type included; a group choice that names no option is
    reported with those, before the rules, which would judge another config: `choice_problems`). `hydra`: composed
    with Hydra's own config, in the one composition, so that overrides of Hydra's keys and groups
    (`hydra.job.chdir=...`, `hydra/job_logging=...`) are checked too: their problems first in the list (a choice of
    Hydra's groups that names no option does not stop the config's rules, which do not read Hydra's config).
    `config_name`: the primary config in `conf`, as `relax-train -cp <conf> -cn <config_name>` names it: a run's
    saved config is checked as the run checks it (`to_relax_config` with the overrides, its note not printed: the
    run prints it), each problem named as on Relax's config (`schema_view`)."""
    dc, named, dropped, choices, mistyped, found, own_mistyped = _composed(overrides, conf, hydra, config_name)
    if choices:
        raise ConfigError([*found, *choice_problems(named, dropped, choices, mistyped)])
    own = named is not dc
    return to_relax_config(dc, [*found, *mistyped, *(unknown_key(named, key) for key in dropped)],
                           overrides=overrides if own else None, left_out=[v.fields[0] for v in mistyped], note=not own,
                           saved=(named, own_mistyped) if own else None)
