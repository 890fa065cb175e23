"""What is wrong with `relax-train <args>`, found before anything starts or is written: the config composed and
validated as relax-train composes it (a run; each job of a `-m` sweep; composition only for `--cfg`, which prints a
config rather than running it). Shared by relax-train and relax-submit (which checks before it submits), so that
both say the same thing: every problem at once, as one message, without a traceback."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

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
    value = re.sub(r"\\(.)", r"\1", match.group(1))  # a sweep job's override has Hydra's escapes (mymod\:TOOLS)
    return (f"{key}={value}: {key} is a list, written in brackets: {key}=[{value}] (several items: "
            f"{key}=[a,b]; in a shell, quote it: '{key}=[{value}]')")


def hydra_error_message(exc: BaseException) -> str:
    """Hydra's exception plus its cause (the useful part, e.g. "Key 'x' not in 'GRPOConfig'"); a list option given
    without brackets is named with the form it takes (`_unbracketed_list`)."""
    unbracketed = _unbracketed_list(exc)
    if unbracketed is not None:
        return unbracketed
    parts = [str(exc).strip()]
    if getattr(exc, "override", None):  # OverrideParseException: name the override the grammar refused
        parts[0] = f"cannot parse override {exc.override!r}: {parts[0]}"  # type: ignore[attr-defined]
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


_CREDENTIALS = re.compile(r"(://)[^/@\s]+@")  # the user[:password]@ of a URL


def _plain(overrides: Sequence[str]) -> list[str]:
    """The overrides of the config (Hydra's own, `hydra.*` and `hydra/...`, left out), and `hydra.searchpath`, which
    adds the config groups of a directory (`hydra.searchpath=[file:///dir]`) and so decides what composes."""
    return [o for o in overrides
            if o.split("=", 1)[0] == "hydra.searchpath" or not o.lstrip("+~").startswith(("hydra.", "hydra/"))]


def job_problem(overrides: Sequence[str], conf: Optional[Path] = None, *, rules: bool = True,
                environment: bool = True, start_checks: bool = False) -> Optional[str]:
    """The message of what is wrong with the config of `relax-train <overrides>` (one job), None when it is valid.
    `rules=False`: only whether it composes (every key known, every value of its type). `environment=False`: the
    job runs elsewhere, so the rules that read this process's environment (`ENVIRONMENT_FIELDS`) are not checked.
    `start_checks`: a valid config also passes the checks a start runs before Ray that read the config alone
    (`relax.runner.preflight.CONFIG_CHECKS`), as relax-submit checks a job before it submits it."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from relax.config import ConfigError, load_config
    from relax.config.compose import compose_checked
    from relax.config.validate import ENVIRONMENT_FIELDS

    cfg = None
    try:
        if rules:
            cfg = load_config(_plain(overrides), conf)
        else:
            _, unknown = compose_checked(_plain(overrides), conf)
            if unknown:
                raise ConfigError(unknown)
    except ConfigError as exc:
        if not environment:
            kept = [v for v in exc.violations if not set(v.fields) <= ENVIRONMENT_FIELDS]
            if kept:
                exc = ConfigError(kept)
            elif not start_checks or exc.config is None:
                return None
            else:  # only the environment's rules (a key's variable unset here, set where it runs): the config is
                # otherwise valid, and the start checks that read it alone still apply
                cfg = exc.config
        if cfg is None:
            n = len(exc.violations)
            return f"invalid config ({n} problem{'s' if n > 1 else ''}):\n{exc}"
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        return hydra_error_message(exc)
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


def problems(args: Sequence[str], conf: Optional[Path] = None, *, environment: bool = True,
             start_checks: bool = False) -> Optional[str]:
    """What is wrong with `relax-train <args>` (its command line, Hydra's flags included), None when nothing is
    (or when a Hydra flag other than -m and --cfg makes it something this does not check: --info, --config-name,
    ...). A sweep: every invalid job, numbered as the sweep numbers them. `start_checks`: as `job_problem`'s."""
    from hydra.errors import HydraException

    args = list(args)
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
    if not multirun:
        return job_problem(overrides, conf, rules=rules, environment=environment, start_checks=start_checks)
    try:
        jobs = sweep_jobs(_plain(overrides))
    except HydraException as exc:
        return hydra_error_message(exc)
    found = []
    for index, job in enumerate(jobs):
        problem = job_problem(job, conf, rules=rules, environment=environment, start_checks=start_checks)
        if problem is not None:
            if problem.startswith("invalid config ("):  # the violations alone, as the sweep launcher lists them
                problem = problem.split("\n", 1)[1]
            # a URL's user:password@ masked: the rules refuse credentials in URLs, whose message never echoes them
            header = _CREDENTIALS.sub(r"\1***@", " ".join(job))
            found.append(f"job {index} ({header}):\n" + textwrap.indent(textwrap.dedent(problem), "  "))
    if not found:
        return None
    n = len(jobs)
    return (f"invalid config in {len(found)} of {n} sweep job{'s' if n > 1 else ''} (nothing started):\n"
            + "\n".join(found))
