"""What is wrong with `relax-train <args>`, found before anything starts or is written: the config composed and
validated as relax-train composes it (a run; each job of a `-m` sweep; composition only for `--cfg`, which prints a
config rather than running it). Shared by relax-train and relax-submit (which checks before it submits), so that
both say the same thing: every problem at once, as one message, without a traceback."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

    from relax.algorithms.base import Violation
    from relax.config import RelaxConfig

MULTIRUN_FLAGS = ("-m", "--multirun")
CFG_FLAGS = ("-c", "--cfg")


# OmegaConf's words for a value that is not a list given to a list option (data.tools, plugins, train.eval_pass_k)
_NOT_A_LIST = "is not a ListConfig, list or tuple"
_MERGING = re.compile(r"Error merging override \S+?=(.*)")


def _unbracketed_list(exc: BaseException) -> Optional[str]:
    """The message for an override that gives a list option a bare value (`data.tools=mymod:TOOLS`, which OmegaConf
    refuses as "str is not a ListConfig, list or tuple"): the option, and the accepted form, the value in brackets.
    None for any other error."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    match = _MERGING.fullmatch(first)
    cause = exc.__cause__ or exc.__context__
    while cause is not None and _NOT_A_LIST not in str(cause):
        cause = cause.__cause__ or cause.__context__
    key = getattr(cause, "full_key", None)
    if match is None or not key:
        return None
    from relax.config.value_types import list_form

    return list_form(key, re.sub(r"\\(.)", r"\1", match.group(1)))  # a sweep job's override has Hydra's escapes


_PLAIN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./")
# a value meant as one of the grammar's own forms: a list, a dict, a quoted value, a function (`choice(...)`,
# `range(...)`), an interpolation; quoting it whole would make it a string, which is not what was meant
_GRAMMAR_FORM = re.compile(r"[\[{'\"]|\w+\(|.*\$\{")


def _quoting_hint(override: str, *, sweep: bool) -> Optional[str]:
    """For an override `key=value` Hydra's grammar refused because its value holds a character the grammar reads
    as syntax unquoted (`=`, as every sweep job's checkpoint directory holds: `checkpoints/<exp>/algorithm=rloo-seed1`;
    `[`, `#`, `~` ...): how to write it, the value quoted for Hydra inside the shell's quotes
    (`"train.resume='checkpoints/x/algorithm=rloo-seed1'"`), a form checked to parse. In a sweep (`sweep`) each of
    a value's comma-separated choices is quoted on its own, so that they stay the sweep's choices. None for any other
    override, and for a value written as one of the grammar's own forms (a list, a dict, a function, quoted)."""
    from relax.config.store import parses, quoted_override

    key, sep, value = override.partition("=")
    if not sep or not value or _GRAMMAR_FORM.match(value):
        return None
    culprit = next((c for c in dict.fromkeys(value) if c not in _PLAIN_CHARS and not parses(f"k=a{c}a")), None)
    if culprit is None:
        return None
    choices = value.split(",") if sweep else [value]
    shell = quoted_override(key, choices)
    if shell is None:
        return None
    what = "each value" if len(choices) > 1 else "a value"
    return f"{what} holding {culprit!r} must be quoted for Hydra: {shell}"


def hydra_error_message(exc: BaseException, *, sweep: bool = False) -> str:
    """Hydra's exception plus its cause (the useful part, e.g. "Key 'x' not in 'GRPOConfig'"); a list option given
    without brackets is named with the form it takes (`_unbracketed_list`); an override whose value needs quoting
    for Hydra's grammar (a path holding `=`) in one line, with the quoted form (`_quoting_hint`; `sweep`: the
    override is a sweep's, whose comma-separated values are its choices)."""
    unbracketed = _unbracketed_list(exc)
    if unbracketed is not None:
        return unbracketed
    parts = [str(exc).strip()]
    if getattr(exc, "override", None):  # OverrideParseException: name the override the grammar refused
        parts[0] = f"cannot parse override {exc.override!r}: {parts[0]}"  # type: ignore[attr-defined]
        hint = _quoting_hint(exc.override, sweep=sweep)  # type: ignore[attr-defined]
        if hint is not None:  # the way to write it, rather than Hydra's pointer to its grammar
            return f"{parts[0].splitlines()[0]}; {hint}"
    cause = exc.__cause__ or exc.__context__
    while cause is not None and len(parts) < 4:
        text = str(cause).strip()
        if text and text != "None" and text not in parts[-1]:
            parts.append(text)
        cause = cause.__cause__ or cause.__context__
    keep = []
    for line in "\n".join(parts).splitlines():
        if line.strip().startswith("Config search path"):
            break  # Hydra's search-path dump: noise for a user
        if line.strip().startswith("To append to your config use"):
            continue  # Hydra's advice to `+` a key the schema lacks: the schema refuses it too
        if line.strip().endswith("_schema") or "$VALUE" in line or line.strip().startswith(("object_type=",
                                                                                          "reference_type=")):
            continue  # internal schema nodes and OmegaConf's template lines
        keep.append(line)
    return "\n".join(keep).strip()


def _plain(overrides: Sequence[str]) -> list[str]:
    """The overrides of the config (Hydra's own, `hydra.*` and `hydra/...`, left out), and `hydra.searchpath`, which
    adds the config groups of a directory (`hydra.searchpath=[file:///dir]`) and so decides what composes."""
    return [o for o in overrides
            if o.split("=", 1)[0] == "hydra.searchpath" or not o.lstrip("+~").startswith(("hydra.", "hydra/"))]


LAUNCHER_KEY = "hydra.launcher"  # the launcher's options: `hydra.launcher.<name>=...`
LAUNCHER_GROUP = "hydra/launcher"  # which launcher: `hydra/launcher=relax_ray` (conf/config.yaml's), `basic`


def _launcher_override(override: str) -> bool:
    from relax.config.store import override_key

    key = override_key(override)
    return key == LAUNCHER_GROUP or key == LAUNCHER_KEY or key.startswith(LAUNCHER_KEY + ".")


def invalid_config(violations: Sequence[Violation]) -> str:
    """The message of a config with `violations` (one or more), as every command of a config says it (relax-train,
    its sweep jobs, relax-submit, relax-serve): `invalid config (n problems):`, then a line for each."""
    from relax.config.validate import format_violations

    n = len(violations)
    return f"invalid config ({n} problem{'s' if n > 1 else ''}):\n{format_violations(list(violations))}"


def load_failure(exc: BaseException, extra: Sequence[Violation] = ()) -> str:
    """The message of a config that did not load, raising `exc`: a `relax.config.ConfigError`'s violations, after
    `extra` (problems found elsewhere: a key given twice, the launcher's options), in the one list
    (`invalid_config`); Hydra's or OmegaConf's own refusal (`hydra_error_message`), after the list of `extra`."""
    from relax.config import ConfigError

    if isinstance(exc, ConfigError):
        return invalid_config([*extra, *exc.violations])
    return (invalid_config(extra) + "\n" if extra else "") + hydra_error_message(exc)


def _launcher_options(node: object) -> Optional[list[str]]:
    """The options of the launcher config dataclass behind `node` (`_target_` left out), None when it has none."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return None
    t = OmegaConf.get_type(node)
    return [f.name for f in dataclasses.fields(t) if f.name != "_target_"] if dataclasses.is_dataclass(t) else None


def _unknown_launcher_key(key: str, options: list[str], choice: str) -> Violation:
    """`key` (`hydra.launcher.<name>[...]`), which the launcher `choice`'s config dataclass lacks: named as an unknown
    key of the config is (`relax.config.unknown_keys`), with the launcher's closest options."""
    import difflib

    from relax.algorithms.base import Violation

    name, _, rest = key[len(LAUNCHER_KEY) + 1:].partition(".")
    if name in options:  # a key inside an option that is a mapping (`ray_init`): Hydra adds one only with `+`
        return Violation((key,), f"unknown key {key}: {LAUNCHER_KEY}.{name} has no key {rest!r} to set; add it with "
                                 f"+{key}=...")
    close = difflib.get_close_matches(name, options, n=3)
    if close:
        return Violation((key,), f"unknown key {key} (did you mean "
                                 f"{' or '.join(f'{LAUNCHER_KEY}.{c}' for c in close)}?)")
    have = f"its options: {', '.join(options)}" if options else "it has no options"
    return Violation((key,), f"unknown key {key}: the launcher {LAUNCHER_GROUP}={choice} has no option {name!r} "
                             f"({have})")


def _no_such_launcher(override: str, conf: Optional[Path]) -> Optional[Violation]:
    """For `hydra/launcher=NAME` that names no launcher: the violation of the choice, with the group's options, as
    for the other `hydra/<group>=` choices (`compose_known`); else (a launcher that is there, another launcher
    override) None. Composed with that override alone: which launchers there are does not depend on the rest."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from relax.config.compose import compose
    from relax.config.unknown_keys import compose_known

    key, eq, _ = override.partition("=")
    if not eq or key.startswith("~") or key.lstrip("+").split("@", 1)[0] != LAUNCHER_GROUP:
        return None
    try:
        _, _, choices, _ = compose_known(lambda kept: compose(kept, conf=conf, hydra=True), [override])
    except (HydraException, OmegaConfBaseException, ValueError):
        return None  # refused for another reason: the sweeps-only line still says what to do
    return next((v for v in choices if v.fields[0] == LAUNCHER_GROUP), None)


def launcher_problems(overrides: Sequence[str], conf: Optional[Path] = None, *,
                      sweep: bool) -> list[Violation]:
    """What is wrong with the launcher overrides among `overrides` (`hydra.launcher.<name>=...`, with or without `+`,
    and `hydra/launcher=...`), which the config's own check leaves to Hydra (`_plain`): a key the launcher's config
    dataclass lacks (Hydra's own refusal names no alternative, and its advice to `+` it ends in a TypeError from the
    launcher's constructor), with what was meant; a launcher that is not there. Without `-m` (`sweep=False`) each is
    refused: a single run starts no launcher, so its options would be accepted and ignored."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from relax.algorithms.base import Violation
    from relax.config.compose import compose
    from relax.config.unknown_keys import compose_known

    given = [o for o in overrides if _launcher_override(o)]
    if not given:
        return []
    if not sweep:  # a launcher that is not there is named as such (with the options): -m would not help it
        return [_no_such_launcher(o, conf) or
                Violation((o.split("=", 1)[0].lstrip("+~"),),
                          f"{o}: launcher options ({LAUNCHER_KEY}.*, {LAUNCHER_GROUP}=...) apply to sweeps (-m) "
                          "only: a run without -m starts no launcher and would ignore it (drop it, or sweep with "
                          "relax-train -m ...)") for o in given]
    try:  # one job's overrides: an experiment file (`+experiment=...`) may set the launcher too
        first = sweep_jobs(list(overrides))[0]
    except HydraException as exc:
        return [Violation((LAUNCHER_KEY,), hydra_error_message(exc, sweep=True))]
    # the whole job's, else (a value of the config that does not compose, which the job's check reports) Hydra's own
    hydra_only = [o for o in first if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    error: Optional[BaseException] = None
    for attempt in (first, hydra_only):
        try:
            dc, dropped, choices, mistyped = compose_known(lambda kept: compose(kept, conf=conf, hydra=True), attempt)
            break
        except (HydraException, OmegaConfBaseException, ValueError) as exc:
            error = exc
    else:
        assert error is not None
        return [Violation((LAUNCHER_KEY,), hydra_error_message(error))]
    # a value not of its option's type (`hydra.launcher.max_concurrent_jobs=abc`); the config's own are the job's
    found = [v for v in choices if v.fields[0] == LAUNCHER_GROUP]
    found += [v for v in mistyped if v.fields[0].startswith(LAUNCHER_KEY + ".")]
    launcher = OmegaConf.select(dc, LAUNCHER_KEY)
    options = _launcher_options(launcher)
    if options is None:  # a launcher without a config dataclass: Hydra checks its keys
        return found
    choice = str(OmegaConf.select(dc, "hydra.runtime.choices", default={}).get(LAUNCHER_GROUP, "?"))
    unknown = [k for k in dropped if k.startswith(LAUNCHER_KEY + ".")]
    unknown += [f"{LAUNCHER_KEY}.{k}" for k in launcher.keys() if k != "_target_" and k not in options]  # `+`-added
    return found + [_unknown_launcher_key(k, options, choice) for k in dict.fromkeys(unknown)]


def _hydra_override(override: str) -> bool:
    """Whether `override` is of one of Hydra's own keys or groups (`hydra.job.chdir=true`, `~hydra.job.chdir`,
    `hydra/job_logging=disabled`), the launcher's (`launcher_problems`) and `hydra.searchpath` (which the config's
    own check composes with, as it decides what composes) aside."""
    key = override.split("=", 1)[0].lstrip("+~")
    return (key.startswith(("hydra.", "hydra/")) and key != "hydra.searchpath"
            and not _launcher_override(override))


def load(overrides: Sequence[str], conf: Optional[Path] = None, config_name: str = "config") -> RelaxConfig:
    """`relax.config.load_config` of `overrides` (a job's, a relax-serve's command line), composed with Hydra's own
    config where they set one of its keys or choose in one of its groups (`_hydra_override`), so that those are
    checked in the same composition: a value not of its key's type, a key or a choice Hydra's config lacks, in the
    one list of the config's problems rather than in Hydra's words after it (raises ConfigError). `config_name`:
    the primary config in `conf` (`-cn`; with `-cp`, a config of its own)."""
    from relax.config import load_config

    return load_config(overrides, conf, hydra=any(_hydra_override(o) for o in overrides), config_name=config_name)


def hydra_value_problems(overrides: Sequence[str], conf: Optional[Path] = None, *, sweep: bool) -> list[Violation]:
    """What is wrong with the overrides among `overrides` of Hydra's own keys and groups outside the launcher's
    (`_hydra_override`), for a sweep, whose jobs' configs are checked without them (`_plain`): each job's Hydra
    overrides composed with Hydra's config (`relax.config.unknown_keys.hydra_problems`: a value not of its key's type,
    a key Hydra's config lacks, a choice none of its group's options), one problem once, listed as the sweep's own
    before its jobs'. (A run's are checked in its config's composition: `load`.)"""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from relax.algorithms.base import Violation
    from relax.config.compose import compose
    from relax.config.unknown_keys import compose_known, hydra_problems

    given = [o for o in overrides if _hydra_override(o)]
    if not given:
        return []
    try:
        jobs = sweep_jobs(given) if sweep else [given]
    except HydraException as exc:
        return [Violation((given[0].split("=", 1)[0].lstrip("+~"),), hydra_error_message(exc, sweep=sweep))]
    found: dict[str, Violation] = {}
    for job in dict.fromkeys(tuple(j) for j in jobs):
        try:
            dc, dropped, choices, mistyped = compose_known(lambda kept: compose(kept, conf=conf, hydra=True), job)
        except (HydraException, OmegaConfBaseException, ValueError):
            continue  # anything else Hydra refuses in these: its own message, when it composes the run
        for v in hydra_problems(dc, dropped, choices, mistyped):
            found.setdefault(v.message, v)
    return list(found.values())


def job_problem(overrides: Sequence[str], conf: Optional[Path] = None, *, rules: bool = True,
                environment: bool = True, start_checks: bool = False,
                extra: Sequence[Violation] = (), config_name: str = "config") -> Optional[str]:
    """The message of what is wrong with the config of `relax-train <overrides>` (one job), None when it is valid.
    `rules=False`: only whether it composes (every key known, every value of its type). `environment=False`: the
    job runs elsewhere, so the rules that read this process's environment (`ENVIRONMENT_FIELDS`) are not checked.
    `start_checks`: a valid config also passes the checks a start runs before Ray that read the config alone
    (`relax.runner.preflight.CONFIG_CHECKS`), as relax-submit checks a job before it submits it. `extra`: problems
    found elsewhere (`launcher_problems`), listed first among the config's. `config_name`: the primary config in
    `conf` (`-cn`; with `-cp`, a config of its own: `problems`)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from relax.config import ConfigError
    from relax.config.compose import compose_checked
    from relax.config.validate import ENVIRONMENT_FIELDS

    # the config's overrides and Hydra's, in one composition (the launcher's are `extra`'s: `launcher_problems`)
    checked = [o for o in overrides if not _launcher_override(o)]
    cfg = None
    try:
        if rules:
            cfg = load(checked, conf, config_name)
        else:
            _, unknown = compose_checked(checked, conf, hydra=any(_hydra_override(o) for o in checked),
                                         config_name=config_name)
            if unknown:
                raise ConfigError(unknown)
    except ConfigError as exc:
        if not environment:
            kept = [v for v in exc.violations if not set(v.fields) <= ENVIRONMENT_FIELDS]
            if kept:
                exc = ConfigError(kept)
            elif not start_checks or exc.config is None:
                return invalid_config(extra) if extra else None
            else:  # only the environment's rules (a key's variable unset here, set where it runs): the config is
                # otherwise valid, and the start checks that read it alone still apply
                cfg = exc.config
        if cfg is None:
            return load_failure(exc, extra)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        return load_failure(exc, extra)
    if extra:  # `extra`'s problems (the launcher's options) are the config's, reported with them
        return invalid_config(extra)
    if start_checks and cfg is not None:
        from relax.runner.preflight import config_check_problem

        if (problem := config_check_problem(cfg)) is not None:
            return f"a start would stop before Ray: {problem}"
    return None


def sweep_jobs(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of each job of `relax-train -m <overrides>`, in the order (and so the index) Hydra's sweeper
    gives them (raises Hydra's OverrideParseException for an override its grammar refuses)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _override_name(override: Override) -> str:
    """The key (or group, with its `@package`) a parsed Hydra override sets: `+train.lr`, `++train.lr`, `~train.lr`
    and `train.lr` all name train.lr."""
    return override.key_or_group + (f"@{override.package}" if override.package else "")


def _kept(overrides: Sequence[str], sets: Sequence[int], deletions: Sequence[int]) -> tuple[int, str]:
    """Where, and as what, the rest of the command line is checked with one override of a key given more than once
    (`sets`, `deletions`: the indices of its overrides that give it a value and that delete it): the last value, in
    the form of the first and the last value that composes alone: `++` (sets a key whether or not it is there) if
    either was written so, else none (a key the schema has) if either was, else `+` (a key it lacks). The last as
    written may not compose alone (`train.lr=1e-5 +train.lr=2e-5`: `+` appends a key, and the schema has it), nor
    the first's form (`+train.lr=1e-5 train.lr=2e-5`), and a refusal, in Hydra's words and of an override the user
    did not write, would follow the message that already names the repeat. Only deletions: the last."""
    if not sets:
        return deletions[-1], overrides[deletions[-1]]
    forms = {overrides[i][:len(overrides[i]) - len(overrides[i].lstrip("+"))] for i in (sets[0], sets[-1])}
    form = "++" if "++" in forms else "" if "" in forms else "+"
    return sets[-1], form + overrides[sets[-1]].lstrip("+")


def duplicate_problems(overrides: Sequence[str], *, command: str) -> tuple[list[Violation], list[str]]:
    """The keys (and group choices) that `overrides` set more than once (`train.lr=1e-5 train.lr=2e-5`, with or
    without `+`/`++`), each named with its values: Hydra would take the last silently. A key both given a value and
    deleted (`train.lr=1e-5 ~train.lr`) is a contradiction, named as one with both. A sweep's values are one override
    (`-m train.lr=1e-5,2e-5`), not a repeat. Also `overrides` with one override for each such key (`_kept`: the last
    value), so that the rest of the command line is still checked. `command` chooses the advice beside "give it
    once": "run" (relax-train without -m: sweep with -m), "sweep" (relax-train -m: one override of the values),
    "config" (a command of one config, relax-serve: none). A key given with the same value each time gets no sweep
    advice either."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from relax.algorithms.base import Violation

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:  # the grammar's refusal is reported where the command line is composed
        return [], list(overrides)
    given: dict[str, list[int]] = {}
    for i, o in enumerate(parsed):
        given.setdefault(_override_name(o), []).append(i)
    found, kept = [], dict(enumerate(overrides))
    for name, where in given.items():
        if len(where) < 2:
            continue
        from relax.config.credentials import masked_override

        shown = [masked_override(overrides[i]) for i in where]
        sets = [i for i in where if not parsed[i].is_delete()]
        deletions = [i for i in where if parsed[i].is_delete()]
        for i in where:
            del kept[i]
        at, override = _kept(overrides, sets, deletions)
        kept[at] = override
        if sets and deletions:
            named = dict(zip(where, shown, strict=True))
            setting, deleting = " and ".join(named[i] for i in sets), " and ".join(named[i] for i in deletions)
            found.append(Violation((name,), f"{name} is both set and deleted: {setting} "
                                            f"{'set' if len(sets) > 1 else 'sets'} it, {deleting} "
                                            f"{'delete' if len(deletions) > 1 else 'deletes'} it; they contradict "
                                            "each other: give one of them"))
            continue
        times = "twice" if len(where) == 2 else f"{len(where)} times"
        values = [o.split("=", 1)[1] for o in shown if "=" in o]
        swept = ",".join(values) if len(values) == len(where) and not any(c in v for v in values for c in ",[{") \
            else "a,b"
        one = command == "config" or name.startswith(("hydra.", "hydra/")) or len(set(values)) < 2
        fix = ("give it once" if one else  # one config, one value, or the same value again
               f"give it once; to run each value, sweep them in one override: {name}={swept}" if command == "sweep"
               else f"give it once (to run each value: relax-train -m {name}={swept})")
        found.append(Violation((name,), f"{name} is given {times}: {', '.join(shown[:-1])} and {shown[-1]}; only "
                                        f"the last would count: {fix}"))
    return found, [kept[i] for i in sorted(kept)]


OWN_CONFIG_FLAGS = {"-cp": "path", "--config-path": "path", "-cn": "name", "--config-name": "name"}


def own_config(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The config of its own that `args` (relax-train's command line) name (`-cp <dir> -cn <name>`, `-cn=<name>`,
    ...): {"path": ..., "name": ...} of those given, and `args` without them."""
    where: dict[str, str] = {}
    rest: list[str] = []
    it = iter(args)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in OWN_CONFIG_FLAGS:
            where[OWN_CONFIG_FLAGS[flag]] = value if eq else next(it, "")
        else:
            rest.append(arg)
    return where, rest


def chooses_launcher(config_file: Path) -> bool | None:
    """Whether a config file's own defaults list chooses a `hydra/launcher` (`override hydra/launcher: basic`);
    None: the file cannot be read as a YAML mapping. Its defaults' own defaults are not followed."""
    import yaml

    try:
        data = yaml.safe_load(config_file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    defaults = data.get("defaults")
    for entry in defaults if isinstance(defaults, list) else []:
        for key in entry if isinstance(entry, dict) else ():
            words = str(key).split()  # "override hydra/launcher", "optional /hydra/launcher@x"
            if words and words[-1].lstrip("/").split("@")[0] == "hydra/launcher":
                return True
    return False


def config_file(directory: str | Path, name: str) -> Path:
    """The YAML file Hydra reads for `-cp <directory> -cn <name>` (`name` with or without its extension)."""
    return Path(directory) / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")


def _chooses_launcher(where: dict[str, str]) -> bool:
    """Whether the config of its own that `where` names (`own_config`: `-cp <dir> -cn <name>`) may choose a launcher
    of its own in its defaults list (`chooses_launcher`; a file it cannot read: may), so that its
    sweep's launcher is not Relax's."""
    if not where.get("path"):
        return False
    return chooses_launcher(config_file(where["path"], where.get("name") or "config")) is not False


_CHOICE_VALUE = re.compile(r"[\w.,-]+")  # an option's name (a sweep's: names and commas), not a value of keys


def own_config_choices(overrides: Sequence[str], where: dict[str, str], conf: Optional[Path]
                       ) -> tuple[list[Violation], list[str]]:
    """For a run of a config of its own (`where`: `own_config`'s, with a `-cp` directory): a violation for each
    override that chooses an option of one of Relax's config groups (`algorithm=m2po`, `+model=tiny`,
    `+experiment=gspo`; a group of `conf`'s, Relax's conf/, that the -cp directory has no directory of), and the
    other overrides. Hydra composes such a run from the -cp directory alone, so the option is not there (Hydra's
    words: "has no option ... its options:" with none, or its advice to `+` it, which leads there), and a run's
    saved config has no defaults list: its keys are what to set. Left to the composition where none is given, or
    where `hydra.searchpath` adds directories to search."""
    from relax.algorithms.base import Violation
    from relax.config.compose import conf_dir

    if not where.get("path") or any(o.split("=", 1)[0].lstrip("+") == "hydra.searchpath" for o in overrides):
        return [], list(overrides)
    root = conf or conf_dir()
    groups = {p.name for p in root.iterdir() if p.is_dir()} if root.is_dir() else set()
    found, rest = [], []
    for o in overrides:
        key, eq, value = o.partition("=")
        group = key.lstrip("+").split("@", 1)[0]
        if not (eq and not key.startswith("~") and group in groups and not (Path(where["path"]) / group).is_dir()
                and _CHOICE_VALUE.fullmatch(value) and value != "null"):
            rest.append(o)
            continue
        if group == "algorithm":
            whose = "its" if "," in value else f"{value}'s"  # a sweep's names (`-m +algorithm=m2po,grpo`)
            keys = f"algorithm.name={value}, and a key of {whose} that the file lacks with +: +algorithm.<key>=..."
        elif group == "experiment":
            keys = f"the keys conf/experiment/{value}.yaml sets"
        else:
            keys = f"{group}.<key>=..., and a key the file lacks with +: +{group}.<key>=..."
        found.append(Violation((group,), f"{o}: a run of its own config (-cp/-cn) chooses no option of Relax's config "
                                         f"groups (Relax's conf/ is not on its search path, and a run's saved config "
                                         f"has no defaults list): set the saved config's keys instead ({keys})"))
    return found, rest


def first_of_sweeps(overrides: Sequence[str]) -> list[str]:
    """The overrides of a sweep's first job (`seed=1,2` -> `seed=1`), the others as written; interval and glob sweeps
    are left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    out = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if not o.is_sweep_override():
            out.append(o.input_line)
            continue
        try:
            out.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
        except (HydraException, StopIteration):
            pass
    return out


def problems(args: Sequence[str], conf: Optional[Path] = None, *, environment: bool = True,
             start_checks: bool = False) -> Optional[str]:
    """What is wrong with `relax-train <args>` (its command line, Hydra's flags included), None when nothing is
    (or when a Hydra flag other than -m, --cfg, -cp/--config-path and -cn/--config-name makes it something this does
    not check: --info, ...). A sweep: every invalid job, numbered as the sweep numbers them.
    `start_checks`: as `job_problem`'s. A run of a config of its own (`-cp <dir> -cn <name>`, a run's saved config;
    `-cn` alone: a config in `conf`) is checked as a run of Relax's: its config composed as relax-train composes it,
    each problem named as on Relax's config (`relax.config.compose.schema_view`: an unknown key with what was meant,
    a value not of its key's type, a `~key` of a key the schema has), and a sweep of it by each job. Its launcher's
    and Hydra's own keys are checked as on Relax's config (a saved config names no launcher: relax-train gives its
    sweep Relax's, `relax.cli.command_line.own_config_launcher`); a sweep of a config file that chooses its own launcher
    leaves that launcher's options to Hydra, as before."""
    from hydra.errors import HydraException

    where, args = own_config(args)
    if where.get("path") is not None and ("://" in where["path"] or not where["path"]):
        return None  # a `pkg://` or `file://` search path: Hydra reads it
    if where.get("path"):  # a relative one from the current directory, as relax-train reads it (absolute_config_path)
        where["path"] = str(Path(where["path"]).expanduser().resolve())
    config_name = where.get("name") or "config"
    job_conf = Path(where["path"]) if where.get("path") else conf
    rules = True
    for flag in CFG_FLAGS:  # `--cfg job`: the config is printed, not run; it must compose
        if flag in args:
            i = args.index(flag)
            del args[i:i + 2]
            rules = False
    multirun = any(a in MULTIRUN_FLAGS for a in args)
    overrides = [a for a in args if a not in MULTIRUN_FLAGS]
    if any(a.startswith("-") for a in overrides):
        return None  # another Hydra flag: Hydra answers it
    # a key set twice is refused; the rest is checked with the last of each, as Hydra would compose it
    repeated, overrides = duplicate_problems(overrides, command="sweep" if multirun else "run")
    chosen, overrides = own_config_choices(overrides, where, conf)  # the rest is checked without them
    # `--cfg` prints the config (`--cfg hydra` the launcher's options) rather than running it: nothing ignored
    launcher = [*repeated, *chosen, *(launcher_problems(overrides, conf, sweep=multirun or not rules)
                             if not (multirun and _chooses_launcher(where)) else [])]
    if multirun:  # a sweep's Hydra overrides, once (a run's are checked with its config: `job_problem`)
        launcher += hydra_value_problems(overrides, conf, sweep=True)
    if not multirun:
        return job_problem(overrides, job_conf, rules=rules, environment=environment, start_checks=start_checks,
                           extra=launcher, config_name=config_name)
    try:
        jobs = sweep_jobs(_plain(overrides))
    except HydraException as exc:
        return (invalid_config(launcher) + "\n" if launcher else "") + hydra_error_message(exc, sweep=True)
    found = []
    for index, job in enumerate(jobs):
        problem = job_problem(job, job_conf, rules=rules, environment=environment, start_checks=start_checks,
                              config_name=config_name)
        if problem is not None:
            if problem.startswith("invalid config ("):  # the violations alone, as the sweep launcher lists them
                problem = problem.split("\n", 1)[1]
            from relax.config.credentials import masked_override

            header = " ".join(map(masked_override, job))  # a URL's secrets masked
            found.append(f"job {index} ({header}):\n" + textwrap.indent(textwrap.dedent(problem), "  "))
    first = invalid_config(launcher) + "\n" if launcher else ""  # the sweep's own options, then its jobs'
    if not found:
        return first.rstrip("\n") or None
    n = len(jobs)
    return (first + f"invalid config in {len(found)} of {n} sweep job{'s' if n > 1 else ''} (nothing started):\n"
            + "\n".join(found))
