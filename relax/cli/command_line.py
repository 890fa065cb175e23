"""relax-train's command line in the one form its checks and Hydra read: a relative `-cp` made absolute, `-cd DIR`
given as Hydra's `hydra.searchpath`, a sweep by `hydra.mode=MULTIRUN` given as `-m`, a sweep that a config file sets
(`hydra.mode: MULTIRUN`, `hydra.sweeper.params`) given as `-m` and its values, a `-cp` config's sweep given
Relax's launcher; and the answers read off it (is it a sweep, which directories are on the search path). relax-train
and relax-submit (which checks a job's command line as the job's relax-train will) both normalise with these."""

from __future__ import annotations

import os
from pathlib import Path

from relax.cli.config_check import MULTIRUN_FLAGS, OWN_CONFIG_FLAGS, chooses_launcher, config_file, own_config


def searchpath_dirs(args: list[str]) -> list[Path]:
    """The directories a `hydra.searchpath=[file://...]` override among `args` adds to Hydra's search path (a plugin's
    conf/, a -cd directory: `config_dir_searchpath`), those that exist; a `pkg://` entry is not read here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from relax.config.store import SEARCHPATH_KEY, override_positions

    found: list[Path] = []
    for i in override_positions(args):
        if args[i].split("=", 1)[0] != SEARCHPATH_KEY or "=" not in args[i]:
            continue
        try:
            value = OverridesParser.create().parse_override(args[i]).value()
        except HydraException:  # Hydra names it
            continue
        for entry in value if isinstance(value, list) else [value]:
            if isinstance(entry, str) and entry.startswith("file://") and Path(entry[len("file://"):]).is_dir():
                found.append(Path(entry[len("file://"):]))
    return found


# Hydra's flags that each choose what its main does: one of them at most (else Hydra's ValueError, a traceback)
MODE_FLAGS = {"-m": "-m", "--multirun": "-m", "-r": "--run", "--run": "--run", "-c": "--cfg", "--cfg": "--cfg",
              "-i": "--info", "--info": "--info", "-sc": "--shell-completion",
              "--shell-completion": "--shell-completion"}
# Hydra's other flags that start as a mode flag does (`-cp` is not `-c p`)
_NOT_MODE = ("-cp", "-cn", "-cd", "-sc")


def mode_flag(arg: str) -> str | None:
    """The mode flag (`MODE_FLAGS`' long form) that the argument `arg` gives as argparse reads it: the flag itself,
    a long one with its value (`--cfg=job`), a short one with its value attached (`-cjob`); else None."""
    if arg in MODE_FLAGS:
        return MODE_FLAGS[arg]
    if arg.startswith("--"):
        return MODE_FLAGS.get(arg.partition("=")[0])
    if arg.startswith(("-c", "-i")) and not arg.startswith(_NOT_MODE):
        return MODE_FLAGS[arg[:2]]
    return None


# the flags naming the directory of a config of its own (`-cp`), as the check parses them
CONFIG_PATH_FLAGS = tuple(flag for flag, what in OWN_CONFIG_FLAGS.items() if what == "path")


def absolute_config_path(args: list[str]) -> list[str]:
    """`args` with the directory of `-cp`/`--config-path` made absolute: Hydra reads a relative one from the
    directory of relax-train's own module, where a user's `-cp checkpoints/.../step_000002` is not."""
    out = list(args)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_PATH_FLAGS and eq and value and "://" not in value:
            out[i] = f"{flag}={Path(value).expanduser().resolve()}"
        elif arg in CONFIG_PATH_FLAGS and i + 1 < len(out) and "://" not in out[i + 1]:
            out[i + 1] = str(Path(out[i + 1]).expanduser().resolve())
    return out


CONFIG_DIR_FLAGS = ("-cd", "--config-dir")  # Hydra's flag adding a directory of YAML options to its search path


class CommandLineError(ValueError):
    """A flag of relax-train's command line that cannot be given as it is: the message is one line."""


def config_dir_searchpath(args: list[str], conf: Path | None = None) -> list[str]:
    """`args` with `-cd DIR` / `--config-dir DIR` / `--config-dir=DIR` given as Hydra's equivalent override,
    `hydra.searchpath=[file://<DIR, absolute>]` (its entry first, before those of a `hydra.searchpath` the command line
    gives: Hydra searches the -cd directory after the primary config's and before hydra.searchpath's; the directory
    made absolute from the working directory, as Hydra makes it), so that relax-train's own config check (which leaves
    a command line with a flag it does not read to Hydra) composes and checks it as Hydra does. Raises
    CommandLineError for a directory that does not exist (Hydra: "Additional config directory ... not found") or a
    flag given twice (Hydra reads the last alone). Left to Hydra as it is where the primary config (`-cn NAME`) is the
    -cd directory's alone (not in `conf`, Relax's conf/, nor in the -cp directory): Hydra finds it there, while a
    `hydra.searchpath` is read only after the primary config (relax-train's check then leaves it to Hydra)."""
    from relax.config.store import with_search_path

    given: list[tuple[int, int, str]] = []  # (index of the flag, arguments it takes, the directory)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_DIR_FLAGS and eq:
            given.append((i, 1, value))
        elif arg in CONFIG_DIR_FLAGS and i + 1 < len(args):
            given.append((i, 2, args[i + 1]))
    given = [g for g in given if not any(h[1] == 2 and g[0] == h[0] + 1 for h in given)]  # `-cd -cd`: a value
    if not given:
        return list(args)
    shown = [f"{args[i]} {args[i + 1]}" if n == 2 else args[i] for i, n, _ in given]
    if len(given) > 1:
        raise CommandLineError(f"{' and '.join(shown)}: -cd/--config-dir is given {len(given)} times and Hydra reads "
                               "the last alone: give it once (several directories: hydra.searchpath=[file:///a,"
                               "file:///b])")
    (i, n, value), = given
    directory = Path(os.path.abspath(Path(value).expanduser()))  # as Hydra reads it (os.path.abspath)
    if not value:
        raise CommandLineError(f"{shown[0]}: no directory given (-cd/--config-dir adds a directory of YAML options to "
                               "Hydra's search path)")
    if not directory.is_dir():
        raise CommandLineError(f"{shown[0]}: {directory} is not a directory (-cd/--config-dir adds a directory of "
                               "YAML options to Hydra's search path)")
    rest = [*args[:i], *args[i + n:]]
    where, _ = own_config(rest)
    if where.get("name"):
        if where.get("path") is not None and (not where["path"] or "://" in where["path"]):
            return list(args)  # a `pkg://` -cp: Hydra reads it (the check too leaves it to Hydra)
        if conf is None:
            from relax.config import conf_dir

            try:
                conf = conf_dir()
            except FileNotFoundError:  # relax-train names it next
                return list(args)
        primary = Path(where["path"]) if where.get("path") else conf
        if not config_file(primary, where["name"]).is_file() and config_file(directory, where["name"]).is_file():
            return list(args)
    return with_search_path(rest, [directory], first=True)


MODE_KEY = "hydra.mode"  # Hydra's run mode: hydra.mode=MULTIRUN sweeps as -m does (Hydra >= 1.2)


def _mode_overrides(args: list[str]) -> list[tuple[int, str | None]]:
    """The overrides among `args` (relax-train's command line, its flags included) that give `hydra.mode`, in any
    form (`hydra.mode=...`, `++hydra.mode=...`, `+hydra.mode=...`, `~hydra.mode`): (the index of each, the mode it
    sets where it sets one as Hydra reads it, `MULTIRUN` or `RUN`, quoted or not; else None)."""
    flags = {i for i, a in enumerate(args) if a in OWN_CONFIG_FLAGS}  # `-cp DIR`, `-cn NAME`: a flag's value
    given = [(i, a) for i, a in enumerate(args) if MODE_KEY in a and not a.startswith("-") and i - 1 not in flags]
    if not given:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    found: list[tuple[int, str | None]] = []
    for i, arg in given:
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except HydraException:  # not an override Hydra reads: the precheck or Hydra names it
            continue
        if override.key_or_group != MODE_KEY or override.package is not None:
            continue
        value = override.value() if override.type != OverrideType.DEL else None
        found.append((i, value if isinstance(value, str) and not override.is_sweep_override() else None))
    return found


def multirun_flag(args: list[str]) -> list[str]:
    """`args` (relax-train's command line), a sweep given as Hydra's `hydra.mode=MULTIRUN` (`+`/`++`, quoted or not)
    given as `-m` instead, first (before the overrides, which Hydra's parser takes as one block): Hydra sweeps the same
    on either, and every check of relax-train (the precheck, which reads -m alone; the launcher's options of a config
    of its own; Hydra's output directory) reads the one form. As they are where Hydra would not sweep on it (another
    flag: `--cfg` prints a config, and with -m Hydra refuses it), or where `hydra.mode` is given more than once (the
    precheck names that)."""
    modes = _mode_overrides(args)
    if len(modes) != 1 or modes[0][1] != "MULTIRUN":
        return list(args)
    _, rest = own_config(args)
    if any(a.startswith("-") and a not in MULTIRUN_FLAGS for a in rest):
        return list(args)
    kept = [a for i, a in enumerate(args) if i != modes[0][0]]
    return kept if any(a in MULTIRUN_FLAGS for a in kept) else ["-m", *kept]


def sweeps(args: list[str]) -> bool:
    """Whether `relax-train <args>` runs a sweep (Hydra's multirun): with -m/--multirun, or with `hydra.mode=MULTIRUN`
    (`multirun_flag`). The one answer relax-train's checks and messages read."""
    return any(a in MULTIRUN_FLAGS for a in multirun_flag(args))


RELAX_LAUNCHER = "hydra/launcher=relax_ray"  # conf/config.yaml's launcher of a sweep


def own_config_launcher(args: list[str], conf: Path | None = None) -> list[str]:
    """`args`, with Relax's sweep launcher (`hydra/launcher=relax_ray`) added to a sweep (-m) of a config of its own
    (`-cp <checkpoint> -cn config`: a run's saved config, which names no launcher), so that it is the sweep a sweep of
    Relax's config is (its jobs checked before any starts, concurrent on Ray, a parent run and a table), not Hydra's
    basic launcher without a word. A launcher given (`hydra/launcher=basic`) is kept, and so is one that the config's
    own defaults list chooses (`override hydra/launcher: basic`): the launcher is added only where the config file
    (in the -cp directory, else `conf`) is found and chooses none."""
    where, _ = own_config(args)
    name = where.get("name")
    if not sweeps(args) or not name or any(a.lstrip("+~").startswith("hydra/launcher=") for a in args):
        return args
    directory = where.get("path") or (str(conf) if conf is not None else None)
    if directory is None or "://" in directory:
        return args
    if chooses_launcher(config_file(directory, name)) is not False:
        return args
    from relax.config.store import with_override

    return with_override(args, RELAX_LAUNCHER)  # among the overrides: before a flag (`--info`) that follows them


SWEEPER_PARAMS_KEY = "hydra.sweeper.params"  # Hydra's BasicSweeper: a config's own sweep values, swept before the
# command line's (a key the command line gives replaces its value, in its place)


# the overrides that bring config files of the user's (or a plugin's) into the composition, where a sweep may be set:
# a search path (-cd too, given as one), a plugin's conf, an experiment file; Relax's own conf/ sets none
# (tests/cli/test_config_file_sweep.py), nor does a config of its own's absence
SWEEP_FILE_KEYS = ("hydra.searchpath", "plugins", "experiment")


def config_sweep(args: list[str], conf: Path | None = None) -> list[str]:
    """`args` (relax-train's command line, as `multirun_flag` gives it), with a sweep that its composed config sets
    rather than the command line (a config of its own, `-cp <dir> -cn <name>`; an experiment file, `+experiment=...`;
    a plugin's conf: `hydra.mode: MULTIRUN`, `hydra.sweeper.params: {seed: 1,2}`) given on the command line, as Hydra
    runs it: Hydra's main reads the composed config's hydra.mode (Hydra >= 1.2) and its sweeper sweeps the params,
    while every check of relax-train (and relax-submit's) reads the command line alone. A composed hydra.mode of
    MULTIRUN is given as -m (`multirun_flag`'s form), and each param as `key=values` before the command line's
    overrides, or the command line's override of its key moved there (Hydra's BasicSweeper sweeps the params first,
    then the command line's, a key given again replacing the param's value in its place): the same jobs, in the same
    order with the same overrides. Raises CommandLineError for a config's hydra.sweeper.params in a run (no -m and
    no hydra.mode MULTIRUN), which Hydra ignores without a word. As given where another flag makes Hydra answer it
    (--cfg, --info, ...), for a `pkg://` -cp, and where the config does not compose (the precheck names why)."""
    from relax.cli.config_check import _launcher_override
    from relax.config.store import override_key, override_positions

    where, rest = own_config(args)
    path = where.get("path")
    if path is not None and (not path or "://" in path):
        return list(args)
    if any(a.startswith("-") and a not in MULTIRUN_FLAGS for a in rest):
        return list(args)
    sweep = any(a in MULTIRUN_FLAGS for a in rest)
    overrides = [a for a in rest if a not in MULTIRUN_FLAGS]
    if not where and not any(override_key(o) in SWEEP_FILE_KEYS for o in overrides):
        return list(args)  # Relax's own conf sets no sweep: nothing to compose (a compose costs every relax-train)
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from relax.config.compose import compose
    from relax.config.unknown_keys import compose_known

    def composed_with(kept: list[str]):
        return compose(kept, config_name=where.get("name") or "config", conf=Path(path) if path else conf, hydra=True)

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        # as Hydra composes the config it reads its mode and sweeper from (`Hydra.get_mode`, multirun): without the
        # sweep overrides (`+experiment=a,b` sweeps the files, it does not compose them); the launcher's options aside
        # (a config of its own gets Relax's launcher after this: `own_config_launcher`), and a key or value it refuses
        # left out (the precheck names it next)
        base = [o.input_line for o in parsed if not o.is_sweep_override() and not _launcher_override(o.input_line)]
        try:
            composed = composed_with(base)
        except Exception:  # noqa: BLE001 - the keys and values that compose, as the precheck composes them
            composed = compose_known(composed_with, base)[0]
        mode = OmegaConf.select(composed, MODE_KEY)
        params = OmegaConf.select(composed, SWEEPER_PARAMS_KEY)
    except Exception:  # noqa: BLE001 - Hydra's and OmegaConf's own errors: the precheck (or Hydra) names them
        return list(args)
    out = list(args)
    if not sweep and getattr(mode, "name", mode) == "MULTIRUN":
        out, sweep = ["-m", *out], True
    if not params:
        return out
    given = [f"{key}={value}" for key, value in params.items()]  # as Hydra's BasicSweeper writes them
    if not sweep:
        raise CommandLineError(f"{SWEEPER_PARAMS_KEY} ({', '.join(given)}), set in the config, applies to sweeps only: "
                               f"a run without -m ignores it (sweep with relax-train -m ..., or run once with "
                               f"hydra.sweeper.params=null)")
    # each param in its place, or the command line's overrides of its key there (Hydra's sweeper keeps a key where it
    # first comes, with its last value), then the command line's other overrides in their order
    at = override_positions(out)
    block: list[str] = []
    moved: set[int] = set()
    try:
        params_parsed = OverridesParser.create().parse_overrides(given)
    except HydraException:  # Hydra's sweeper names it
        return out
    for param, override in zip(given, params_parsed, strict=True):
        same = [j for j, o in enumerate(parsed) if o.get_key_element() == override.get_key_element()]
        block += [out[at[j]] for j in same] if same else [param]
        moved.update(same)
    block += [out[at[j]] for j in range(len(at)) if j not in moved]
    return [*(a for i, a in enumerate(out) if i not in set(at)), *block]
