"""`relax-submit`: run `relax-train <overrides>` on an existing Ray cluster through the Ray Jobs API.

    relax-submit --address http://HEAD:8265 -- algorithm=rloo model=qwen3_0.6b cluster=8xgpu

The job's runtime environment uploads the working directory (this checkout by default, so the
cluster runs exactly the code and conf/ you have) and sets environment variables (`--env KEY=VAL`, or `--env KEY`
for KEY's value here; MODEL_DIR, DATA_DIR and the other variables in FORWARDED_ENV are passed on when set here, and
so are the secrets the run reads from the environment: the variables its `*api_key_env` options name,
$RELAX_SGLANG_API_KEY with rollout.sglang.urls, MLflow's credentials with an http(s) tracking.uri; `secret_env`).
A secret's value, and that of any `--env KEY`, is in no command line and shows as `***` in `--dry-run`, as does
the value of every variable whose name holds KEY, TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL (in any case), however
it was given; a secret
the run needs that is unset here is named before submitting (the cluster's nodes may set it). The
entrypoint is `python -m relax.cli.train`, i.e. relax-train, which works from the uploaded checkout
whether or not Relax is installed on the nodes. With Ray's token authentication (Ray >= 2.52; on
by default for local clusters since 2.59) the client sends the token found in RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, see launch/README.md.

Where the run's records go: the job's driver starts in Ray's temporary copy of the working_dir, which
Ray deletes with the job's runtime environment, so anything relax-train writes relative to it (the
default `sqlite:///mlflow.db`, Hydra's `outputs/`, the checkpoints) would be lost. With `--exp-dir DIR`
(default: $EXP_DIR), an absolute directory on storage the cluster's nodes share, the job runs
relax-train in DIR (created if missing; the code still comes from the uploaded working_dir), so the
MLflow store, outputs and checkpoints land in DIR exactly as a local run in DIR would write them.
Without it, every place the run writes to must be absolute (or an MLflow server URI): a relative
`tracking.uri`, `train.save_dir` (or none) or `hydra.run.dir`/`hydra.sweep.dir` is refused before
anything is submitted (exit 2, each field named). `dry_run=true` writes nothing and is not checked.
These checks (where the run writes, which secrets it reads, how long it takes to stop) read each job's config,
composed once for all three (`job_configs`), Relax's or a config of its own (`-cp <dir> -cn <name>`, a run's saved
config: its values with the command line's, the schema's defaults for a key it lacks). A `-cp` that starts with `~`
is refused: on the cluster it is the home directory of the user the job runs as, which cannot be read here.
Before that, the config is composed and validated here exactly as relax-train does (`relax.cli.config_check`; every
job of a sweep; the modules of `plugins=[...]` imported first, from the working directory as the job imports them or
from this environment), and put through the checks relax-train runs before Ray that read the config alone
(`relax.runner.preflight.CONFIG_CHECKS`: a `data.tool_parser` that nothing of the run reads): a config the job would
refuse is refused with relax-train's message (exit 2), nothing submitted. Its other checks before Ray read what only
the cluster has (the model and data files under its MODEL_DIR and DATA_DIR, the reward and agent modules with its
packages, the addresses as it reaches them, its GPUs, the checkpoint directory) and run in the job.

Stopping: `ray job stop` sends SIGTERM and SIGKILLs the job RAY_JOB_STOP_WAIT_TIME_S later (Ray's default: 3 s); the
job gets the longest relax-train takes to stop with a checkpoint (`stop_grace_s`), or `--stop-grace-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, TextIO

from relax.runner.ray_auth import enable_token_auth

USAGE_EXIT = 2
FORWARDED_ENV = ("MODEL_DIR", "DATA_DIR", "EXP_DIR", "RLOO_DATA_CACHE_DIR", "RELAX_MODEL_CACHE_DIR",
                 "RELAX_TOKENIZER_CACHE_DIR", "HF_HOME")
# Never uploaded: run outputs, stores and caches (Ray caps a working_dir upload at a few hundred MiB).
EXCLUDES = [".git", "**/__pycache__", "outputs", "multirun", "mlruns", "mlflow.db", "compare", "*.egg-info",
            ".pytest_cache", ".ruff_cache", "**/checkpoints", "*.pt", "*.safetensors", "*.gguf"]
TRAIN_ENTRYPOINT = "python -m relax.cli.train"
EXP_DIR_ENV = "EXP_DIR"
# Hydra's sweep flags; any other flag (--cfg, --info, ...) makes relax-train print instead of run: nothing to check.
_MULTIRUN_FLAGS = ("-m", "--multirun")
# STOPPED: `ray job stop` (or the dashboard's Stop) sends SIGTERM (Ray's RAY_JOB_STOP_SIGNAL default) and Ray reports
# no exit code for a stopped job: 143 is what relax-train itself exits with after a SIGTERM
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 143}
# Ray's JobSupervisor (ray/dashboard/modules/job/job_supervisor.py) waits this many seconds after `ray job stop`'s
# SIGTERM, then SIGKILLs the entrypoint and every process under it; Ray's default is 3 s. The supervisor actor gets
# the job's runtime_env env_vars, so the job's own value is the one it reads.
STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"


@contextmanager
def job_environment(env: dict[str, str]) -> Iterator[None]:
    """The job's `--env` variables set in this process while its config is read here (`${oc.env:KEY}` then
    resolves as it will in the job); the environment restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def default_working_dir() -> Path:
    """This checkout when Relax runs from one (its conf/ and code travel with the job), else the cwd."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and (repo / "conf" / "config.yaml").is_file():
        return repo
    return Path.cwd()


def parse_env(items: list[str], environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """FORWARDED_ENV variables that are set here, then `--env KEY=VAL` or `--env KEY` (KEY's value here), which win.
    Raises ValueError for a `--env KEY` that is not set here."""
    environ = dict(os.environ) if environ is None else environ
    env = {k: environ[k] for k in FORWARDED_ENV if environ.get(k)}
    for item in items:
        key, sep, value = item.partition("=")
        if not key:
            raise ValueError(f"--env expects KEY=VALUE or KEY, got {item!r}")
        if not sep:
            if key not in environ:
                raise ValueError(f"--env {key}: {key} is not set here (--env expects KEY=VALUE, or KEY to pass on "
                                 "its value from this environment)")
            value = environ[key]
        env[key] = value
    return env


def env_from_here(items: list[str]) -> set[str]:
    """The variables of `--env KEY` items (no `=`): their values come from this environment, never shown."""
    return {item for item in items if "=" not in item}


# words that make a variable's name look like a secret's (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, PGPASSWORD,
# GOOGLE_APPLICATION_CREDENTIALS): its value is `***` in --dry-run's payload, however it was given
SECRET_NAME_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")


def looks_secret(name: str) -> bool:
    """Whether `name` contains one of SECRET_NAME_WORDS, in any case (`hf_token` too)."""
    upper = name.upper()
    return any(word in upper for word in SECRET_NAME_WORDS)


# secrets the run reads from variables of fixed names: relax.runner.rollout_driver.sglang_engines.API_KEY_ENV (the
# servers at rollout.sglang.urls), and MLflow's credentials for an http(s) tracking server
SGLANG_KEY_ENV = "RELAX_SGLANG_API_KEY"
MLFLOW_CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def api_key_options() -> list[str]:
    """Every option of the schema that names a key's environment variable (a field called `api_key_env`, or ending
    in it, at any depth): reward_model.api_key_env, data.reward_service.api_key_env, ..."""
    import dataclasses

    from relax.config.schema import RelaxConfig

    found: list[str] = []

    def walk(section: object, prefix: str) -> None:
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            elif f.name.endswith("api_key_env"):
                found.append(prefix + f.name)

    walk(RelaxConfig(), "")
    return found


def secret_env(configs: Sequence[Any]) -> dict[str, str]:
    """{variable: the option that makes the run read it} for each secret that the jobs of `configs` (`job_configs`:
    each job of a sweep, a run's one) read from their environment."""
    from omegaconf import OmegaConf

    def value(cfg: Any, key: str) -> Any:
        try:
            return OmegaConf.select(cfg, key, throw_on_missing=False)
        except Exception:  # noqa: BLE001 - an interpolation that only the cluster can resolve
            return None

    options = api_key_options()
    found: dict[str, str] = {}
    for cfg in configs:
        for option in options:
            name = value(cfg, option)
            if isinstance(name, str) and name:
                found.setdefault(name, f"{option}={name}")
        if value(cfg, "rollout.sglang.urls"):
            found.setdefault(SGLANG_KEY_ENV, "rollout.sglang.urls (the servers' key)")
        uri = value(cfg, "tracking.uri")
        if value(cfg, "tracking.enabled") is not False and isinstance(uri, str) and \
                uri.lower().startswith(("http://", "https://")):
            for name in MLFLOW_CREDENTIAL_ENV:
                found.setdefault(name, f"tracking.uri={uri} (MLflow's credentials, when set)")
    return found


def forward_secrets(env: dict[str, str], secrets: dict[str, str], environ: Optional[dict[str, str]] = None) \
        -> list[str]:
    """Add to `env` each of `secrets` (secret_env) that is set here and not given already; returns a note for each
    key variable the run needs that is set neither here nor by --env (MLflow's credentials are optional)."""
    environ = dict(os.environ) if environ is None else environ
    notes = []
    for name, why in secrets.items():
        if name in env:
            continue
        if environ.get(name):
            env[name] = environ[name]
        elif name not in MLFLOW_CREDENTIAL_ENV:
            notes.append(f"{why}: {name} is not set here, so it is not passed on; the job fails unless the "
                         f"cluster's nodes set it (or give --env {name} with it set here)")
    return notes


def shown_payload(payload: dict[str, Any], hidden: set[str]) -> dict[str, Any]:
    """`payload` with the values of the `hidden` environment variables, and of those whose name looks like a
    secret's (`looks_secret`), replaced by `***` (what --dry-run prints)."""
    env = payload.get("runtime_env", {}).get("env_vars", {})
    masked = {k: ("***" if k in hidden or looks_secret(k) else v) for k, v in env.items()}
    return {**payload, "runtime_env": {**payload.get("runtime_env", {}), "env_vars": masked}}


def _sweep(overrides: Sequence[str]) -> bool:
    """Whether the job runs a sweep: with -m, or with Hydra's `hydra.mode=MULTIRUN` (relax-train's one answer)."""
    from relax.cli.command_line import sweeps

    return sweeps(list(overrides))


def job_configs(overrides: Sequence[str], conf: Path) -> Optional[list[Any]]:
    """The config of each job of `relax-train <overrides>` (a sweep's in the order it numbers them; a run's one), each
    composed once, with Hydra's own node, as the job's relax-train composes it: from `conf` (the conf/ that travels
    with the job), or from the config of its own that `-cp <dir> -cn <name>` name (a run's saved config), read as the
    schema's (`relax.config.compose.schema_view`: a key the file lacks holds the schema's default; a sweep of it gets
    Relax's launcher, `relax.cli.command_line.own_config_launcher`). What relax-submit's checks of where the run writes
    (`storage_settings`), which secrets it reads (`secret_env`) and how long it takes to stop (`stop_grace_s`) read,
    whichever config it runs. None for a command that inspects rather than runs (--cfg, --info, ...) and for a
    `-cp` that Hydra resolves itself (`pkg://`, `file://`): `relax.cli.config_check.problems` checks neither.
    Raises ValueError when the config does not compose (the job would fail the same way)."""
    from hydra import compose, initialize_config_dir

    from relax.cli.command_line import own_config_launcher
    from relax.cli.config_check import own_config, sweep_jobs
    from relax.config import register_configs
    from relax.config.compose import schema_view

    where, args = own_config(own_config_launcher(list(overrides), conf))
    if any(a.startswith("-") and a not in _MULTIRUN_FLAGS for a in args):
        return None
    path = where.get("path")
    if path is not None and (not path or "://" in path):
        return None
    plain = [a for a in args if a not in _MULTIRUN_FLAGS]
    try:
        jobs = sweep_jobs(plain) if len(plain) != len(args) else [plain]
        register_configs()
        # a relative -cp from the current directory, as `problems` reads it (relax-submit's check_config has made
        # it the job's: `job_config_path`)
        with initialize_config_dir(config_dir=str(Path(path).resolve() if path else conf), version_base=None):
            return [schema_view(compose(config_name=where.get("name") or "config", overrides=job,
                                        return_hydra_config=True), job) for job in jobs]
    except Exception as exc:  # noqa: BLE001 - Hydra's and OmegaConf's own exception types, a ConfigError
        raise ValueError(f"relax-train {' '.join(overrides)}: the config does not compose: {exc}") from None


def storage_settings(cfg: Any) -> dict[str, Any]:
    """What the job of `cfg` (one of `job_configs`') would use for the keys that decide where it writes. Values are
    resolved where possible (`${oc.env:...}`, `${now:...}`), else left as written."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for key in ("dry_run", "tracking.enabled", "tracking.uri", "train.save", "train.save_dir", "hydra.run.dir",
                "hydra.sweep.dir"):
        parent, _, leaf = key.rpartition(".")
        raw = OmegaConf.to_container(OmegaConf.select(cfg, parent) if parent else cfg, resolve=False).get(leaf)
        value = raw
        if isinstance(raw, str) and "${" in raw:
            try:
                value = OmegaConf.select(cfg, key, throw_on_missing=False)
            except Exception:  # noqa: BLE001 - an interpolation that only the cluster can resolve
                pass
        out[key] = value
        if value != raw:
            out[key + ".raw"] = raw  # shown in messages: `outputs/${now:%Y-%m-%d}`, not today's date
    return out


def stop_grace_s(configs: Sequence[Any], *, sweep: bool) -> int:
    """Seconds `ray job stop` should give the job of `configs` (`job_configs`'; a sweep's: its first job's carries
    the launcher's options) between its SIGTERM and Ray's SIGKILL: the longest relax-train itself may take to stop
    with a checkpoint (docs/operations.md, "Stopping and resuming"), so that Ray's 3 s default does not kill it in the
    middle of the step's checkpoint.

    A run finishes its step (a role that stops progressing is declared hung after cluster.heartbeat_timeout_s), then
    writes its checkpoint (deadline train.checkpoint_timeout_s), then closes its MLflow run (each wait bounded by
    CLOSE_JOIN_S). A sweep (-m) forwards the signal to its jobs, kills those still running after
    hydra.launcher.stop_timeout_s, then closes its parent run.

    Read with the job's `--env` set (`job_environment`). Raises ValueError naming the option whose value cannot be
    read here (an `${oc.env:...}` of a variable only the cluster sets)."""
    import math

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from relax.tracking.run_writer import CLOSE_JOIN_S

    cfg = configs[0]
    keys = (["hydra.launcher.stop_timeout_s"] if sweep
            else ["cluster.heartbeat_timeout_s", "train.checkpoint_timeout_s"])
    wait = 0.0
    for key in keys:
        try:
            wait += float(OmegaConf.select(cfg, key, default=120.0) if sweep else OmegaConf.select(cfg, key))
        except (OmegaConfBaseException, ValueError, TypeError) as exc:
            raise ValueError(f"{key}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    return math.ceil(wait + CLOSE_JOIN_S)


def _is_relative_path(value: str) -> bool:
    # "~" is not expanded (neither by Hydra nor for train.save_dir); "${...}": an interpolation resolved on the cluster
    return not value.startswith(("/", "${"))


def _is_relative_store(uri: str) -> bool:
    """A store that `resolve_tracking_uri` puts under the current directory (sqlite:///x.db, file:x, a plain path)."""
    from relax.tracking.mlflow_run import resolve_tracking_uri

    if uri.startswith("${"):
        return False
    return resolve_tracking_uri(uri, cwd="/nonexistent-a") != resolve_tracking_uri(uri, cwd="/nonexistent-b")


def storage_problems(settings: dict[str, Any], *, sweep: bool) -> list[str]:
    """Each place a submitted run without --exp-dir would write inside the job's temporary working_dir."""
    if settings.get("dry_run"):
        return []

    def shown(key: str) -> str:
        return f"{key}={settings.get(key + '.raw', settings.get(key))}"

    problems = []
    uri = settings.get("tracking.uri")
    if settings.get("tracking.enabled", True) and isinstance(uri, str) and _is_relative_store(uri):
        problems.append(f"{shown('tracking.uri')}: a relative MLflow store; give an absolute one "
                        "(sqlite:////shared/exp/mlflow.db) or a server (http://HOST:5000)")
    save_dir = settings.get("train.save_dir")
    if settings.get("train.save", True):
        if save_dir is None:
            problems.append("train.save_dir is unset: its default is relative to where relax-train runs; give an "
                            "absolute directory (train.save_dir=/shared/exp/checkpoints) or train.save=false")
        elif _is_relative_path(str(save_dir)):
            problems.append(f"{shown('train.save_dir')}: relative; give an absolute directory")
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    run_dir = settings.get(key)
    if run_dir is not None and _is_relative_path(str(run_dir)):
        problems.append(f"{shown(key)}: relative (Hydra's output directory: the resolved config and logs); give an "
                        "absolute directory")
    return problems


def _hydra_conf(working_dir: Path) -> Path:
    """The conf/ relax-train will compose on the cluster: the uploaded one, else the installed one."""
    if (working_dir / "conf" / "config.yaml").is_file():
        return working_dir / "conf"
    from relax.config import conf_dir

    return conf_dir()


def check_storage(overrides: list[str], *, working_dir: Path) -> list[str]:
    """storage_problems of `relax-train <overrides>` (composed by `job_configs`, as `main` checks them); [] for a
    Hydra command that inspects rather than runs (--cfg, --info, ...). Raises ValueError when the config does not
    compose (the job would fail the same way)."""
    return storage_check(job_configs(overrides, _hydra_conf(working_dir)), sweep=_sweep(overrides))


def storage_check(configs: Optional[Sequence[Any]], *, sweep: bool) -> list[str]:
    """storage_problems of every job of `configs` (`job_configs`'), each problem once: a sweep's problem that only
    some of its jobs have names them (Hydra's job numbers, from 0), so that the order of swept values cannot decide
    whether a submission is refused."""
    jobs_of: dict[str, list[int]] = {}
    for job, cfg in enumerate(configs or ()):
        for problem in storage_problems(storage_settings(cfg), sweep=sweep):
            jobs_of.setdefault(problem, []).append(job)
    return [problem if len(jobs) == len(configs) else
            f"{problem} (job{'s' if len(jobs) > 1 else ''} {', '.join(map(str, jobs))} of the sweep)"
            for problem, jobs in jobs_of.items()]


def job_config_path(overrides: list[str], *, working_dir: Path, exp_dir: Optional[str] = None
                    ) -> tuple[list[str], Optional[str]]:
    """`overrides` with a relative `-cp`/`--config-path` (or `-cd`/`--config-dir`) made absolute as the job's
    relax-train reads it: from the directory it runs in, `exp_dir` (--exp-dir, $EXP_DIR), else its copy of
    `working_dir` (Ray uploads it without EXCLUDES). Also the message of why the check here cannot read that
    directory (it is not here, or it is not uploaded), else None. An absolute one is left as it is (the check reads
    it where the job does). One that starts with `~` is refused (the message): the job's relax-train would read it
    in the home directory of the user it runs as on the cluster, which is not the one here (where a check would read
    it)."""
    from fnmatch import fnmatch

    from relax.cli.command_line import CONFIG_DIR_FLAGS
    from relax.cli.config_check import OWN_CONFIG_FLAGS

    out = list(overrides)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if (OWN_CONFIG_FLAGS.get(flag) != "path" and flag not in CONFIG_DIR_FLAGS) or (not eq and i + 1 >= len(out)):
            continue
        short = "-cd" if flag in CONFIG_DIR_FLAGS else "-cp"
        value = value if eq else out[i + 1]
        given = f"{flag}{'=' if eq else ' '}{value}"  # as the user typed it, in the messages
        if value.startswith("~"):  # quoted, or `-cp=~/x`: the shell here left it to the job
            return out, (f"{given}: `~` is the home directory of the user the job runs as on the cluster, "
                         "which relax-submit cannot read here to check the config before submitting (it would read "
                         "yours): give the directory's absolute path on storage the cluster's nodes share")
        if not value or "://" in value or value.startswith("/"):
            continue
        base = working_dir / exp_dir if exp_dir else working_dir
        where = (f"the experiment directory {exp_dir} (--exp-dir/${EXP_DIR_ENV}), where the job runs relax-train"
                 if exp_dir else f"the job's copy of the working_dir (--working-dir {working_dir}), where it runs "
                                 "relax-train")
        path = (base / value).resolve()
        if not exp_dir:
            rel = path.relative_to(working_dir) if path.is_relative_to(working_dir) else None
            if rel is None:
                return out, (f"{given}: a relative config directory is read from {where}; {path} is outside "
                             "it, so the job would not have it: give its absolute path on storage the cluster's "
                             "nodes share")
            left_out = next((p for part in rel.parts for p in EXCLUDES if fnmatch(part, p.removeprefix("**/"))),
                            None)
            if left_out is not None:
                return out, (f"{given}: a relative config directory is read from {where}, but {rel} is not "
                             f"uploaded with it (relax-submit leaves out {left_out!r}: run outputs, stores, "
                             "checkpoints): give its absolute path on storage the cluster's nodes share, or use "
                             f"--exp-dir with {short} relative to it")
        if not path.is_dir():
            return out, (f"{given}: a relative config directory is read from {where}: {path} is not a "
                         f"directory here, so the config cannot be checked before submitting (give {short} as it "
                         "is there, or its absolute path)")
        if eq:
            out[i] = f"{flag}={path}"
        else:
            out[i + 1] = str(path)
    return out, None


def check_config(overrides: list[str], *, working_dir: Path, env: dict[str, str],
                 exp_dir: Optional[str] = None) -> list[str]:
    """Compose and validate `relax-train <overrides>` here, as relax-train would on the cluster (each job of a
    sweep; the job's environment variables set while the rules read them; no Ray, nothing contacted), with the
    checks relax-train runs before Ray that read the config alone (`relax.runner.preflight.CONFIG_CHECKS`): a config
    that the job would refuse is refused before anything is submitted, with relax-train's message (exit 2). Whether
    a key's variable is set is the job's to say: the cluster's nodes may set it where this machine does not.
    A relative `-cp` is read as the job reads it (`job_config_path`: from `exp_dir`, else `working_dir`); returns
    `overrides` with it so (what relax-submit's other checks compose: `job_configs`), and as relax-train normalises
    them before its own check: a `-cd` directory (read as a relative -cp is) as `hydra.searchpath`, a sweep by
    `hydra.mode=MULTIRUN` as -m, a sweep that the composed config sets (`hydra.mode: MULTIRUN`,
    `hydra.sweeper.params`) on the command line (`relax.cli.command_line.config_dir_searchpath`, `multirun_flag`,
    `config_sweep`)."""
    from relax.cli.command_line import CommandLineError, config_dir_searchpath, config_sweep, multirun_flag
    from relax.cli.config_check import problems

    overrides, message = job_config_path(overrides, working_dir=working_dir, exp_dir=exp_dir)
    if message is None:
        try:
            overrides = config_sweep(multirun_flag(config_dir_searchpath(overrides, _hydra_conf(working_dir))),
                                     _hydra_conf(working_dir))
        except CommandLineError as exc:
            message = str(exc)
    if message is not None:
        print(f"relax-submit: error: {message}\nNothing was submitted.", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    with job_environment(env):
        message = problems(overrides, _hydra_conf(working_dir), environment=False, start_checks=True)
    if message is not None:
        print(f"relax-submit: error: {message}\nNothing was submitted.", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    return overrides


def build_submission(overrides: list[str], *, working_dir: Path, env: dict[str, str],
                     entrypoint: Optional[str] = None, submission_id: Optional[str] = None,
                     entrypoint_num_cpus: Optional[float] = None, exp_dir: Optional[str] = None) -> dict[str, Any]:
    """Keyword arguments of `JobSubmissionClient.submit_job` (kept apart from the network call to test it).

    `exp_dir`: relax-train runs there (mkdir -p, cd), importing Relax from the working_dir (PYTHONPATH).
    """
    command = entrypoint or TRAIN_ENTRYPOINT
    if exp_dir is not None:
        quoted = shlex.quote(exp_dir)
        command = f'export PYTHONPATH="$PWD${{PYTHONPATH:+:$PYTHONPATH}}" && mkdir -p {quoted} && cd {quoted} && ' \
                  + command
    if overrides:
        command += " " + " ".join(shlex.quote(o) for o in overrides)
    runtime_env: dict[str, Any] = {"working_dir": str(working_dir), "excludes": list(EXCLUDES)}
    # Ray's job supervisor sets PYTHONUNBUFFERED=1 for the driver (2.60); stated here too, so that the job's log
    # (progress lines, summary) streams whatever Ray runs the job. `--env PYTHONUNBUFFERED=...` still wins.
    env = {"PYTHONUNBUFFERED": "1", **env}
    runtime_env["env_vars"] = dict(env)
    payload: dict[str, Any] = {"entrypoint": command, "runtime_env": runtime_env}
    if submission_id:
        payload["submission_id"] = submission_id
    if entrypoint_num_cpus is not None:
        payload["entrypoint_num_cpus"] = entrypoint_num_cpus
    return payload


class LostContact(RuntimeError):
    """The cluster stopped answering while relax-submit followed a job: the job's state is unknown here."""


async def _follow(client: Any, job_id: str, out: TextIO) -> int:
    """Stream the job's log (from its start) to `out` until the stream ends; returns the characters written.

    Ray's client raises when the websocket is cut without a close frame (close code 1006: a proxy, a network drop,
    the head going away); that ends the stream as a clean close does, and `follow_to_the_end` reads the rest."""
    written = 0
    try:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()
            written += len(lines)
    except Exception:  # noqa: BLE001 - RuntimeError("WebSocket connection closed unexpectedly ..."), aiohttp's
        pass
    return written


def catch_up(client: Any, job_id: str, written: int, out: TextIO) -> int:
    """Write the part of the job's log past the first `written` characters; returns the new count.

    The log stream (a websocket) can end before the job does, e.g. cut by a proxy or an idle timeout during a
    long silent phase; the job's log file is complete, so what the stream missed (progress lines, the final
    summary) is fetched from it instead of being lost.
    """
    try:
        logs = client.get_job_logs(job_id)
    except Exception:  # noqa: BLE001 - a server going away: nothing more to show
        return written
    if len(logs) > written:
        out.write(logs[written:])
        out.flush()
        return len(logs)
    return written


def follow_to_the_end(client: Any, job_id: str, out: TextIO = sys.stdout, poll_s: float = 2.0,
                      lost_after_s: float = 120.0) -> str:
    """Stream the job's log, then whatever the stream missed, until the job is terminal; returns its status.
    LostContact when the cluster does not answer for `lost_after_s` (a head restarting comes back within it)."""
    import time

    written = asyncio.run(_follow(client, job_id, out))
    last_answer = time.monotonic()
    while True:
        try:
            status = str(client.get_job_status(job_id)).split(".")[-1]
        except Exception as exc:  # noqa: BLE001 - requests' ConnectionError, Ray's RuntimeError for a 5xx ...
            if time.monotonic() - last_answer >= lost_after_s:
                raise LostContact(f"{type(exc).__name__}: {exc}") from None
            time.sleep(poll_s)
            continue
        last_answer = time.monotonic()
        written = catch_up(client, job_id, written, out)
        if status in EXIT_CODES:
            return status
        time.sleep(poll_s)


def submit_with_retry(client: Any, payload: dict[str, Any], wait_s: float = 90.0) -> str:
    """submit_job, retried while a just-started head has no job agent yet ("try again later")."""
    import time

    t0 = time.monotonic()
    while True:
        try:
            return client.submit_job(**payload)
        except RuntimeError as exc:
            if "try again later" not in str(exc) or time.monotonic() - t0 > wait_s:
                raise
            time.sleep(2.0)


def exit_code(client: Any, job_id: str, status: str) -> int:
    """The entrypoint's own exit code when Ray reports it (2 = invalid config), else one per status."""
    try:
        code = getattr(client.get_job_info(job_id), "driver_exit_code", None)
    except Exception:  # noqa: BLE001 - older servers
        code = None
    if isinstance(code, int) and (status != "SUCCEEDED" or code == 0):
        return code
    return EXIT_CODES.get(status, 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relax-submit",
        description="Submit `relax-train <overrides>` to a Ray cluster (Ray Jobs API) and follow its logs.",
        epilog="Example: relax-submit --address http://HEAD:8265 -- algorithm=rloo model=qwen3_0.6b cluster=8xgpu",
    )
    p.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"),
                   help="Ray dashboard address, e.g. http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS)")
    p.add_argument("--working-dir", type=Path, default=None,
                   help="directory uploaded as the job's working_dir (default: this Relax checkout, else the cwd); "
                        "the check before submitting imports plugins=[...] from it too, as the job does")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VAL|KEY",
                   help="environment variable of the job (repeatable); KEY alone passes on KEY's value here, never "
                        "shown (the keys named by the config's *api_key_env options are passed on without it); "
                        "--dry-run shows *** for it, and for a name holding KEY, TOKEN, SECRET, PASSWORD, PASSWD or "
                        "CREDENTIAL (any case)")
    p.add_argument("--exp-dir", default=None, metavar="DIR",
                   help="absolute directory on the cluster's shared storage where relax-train runs and writes its "
                        "MLflow store, outputs and checkpoints (default: $EXP_DIR); without it every output path "
                        "must be absolute")
    p.add_argument("--entrypoint", default=None,
                   help=f"command instead of `{TRAIN_ENTRYPOINT}`; the overrides are appended to it")
    p.add_argument("--submission-id", default=None, help="job id to use (default: Ray picks one)")
    p.add_argument("--entrypoint-num-cpus", type=float, default=None, help="CPUs reserved for the driver")
    p.add_argument("--stop-grace-s", type=int, default=None, metavar="S",
                   help="seconds `ray job stop` waits after its SIGTERM before Ray kills the job (the job's "
                        f"{STOP_WAIT_ENV}; Ray's default is 3). Default for relax-train: the longest it takes to "
                        "stop with a checkpoint, from the config (cluster.heartbeat_timeout_s + "
                        "train.checkpoint_timeout_s + 120; a sweep: hydra.launcher.stop_timeout_s + 120)")
    p.add_argument("--no-follow", action="store_true", help="print the job id and return at once")
    p.add_argument("--dry-run", action="store_true", help="print what would be submitted; contact nothing")
    p.add_argument("overrides", nargs="*", help="relax-train overrides (after --)")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        env = parse_env(args.env)
    except ValueError as exc:
        parser.error(str(exc))
    working_dir = (args.working_dir or default_working_dir()).resolve()
    if not working_dir.is_dir():
        parser.error(f"--working-dir {working_dir} is not a directory")
    exp_dir = args.exp_dir or os.environ.get(EXP_DIR_ENV) or None
    hidden = env_from_here(args.env)
    configs: Optional[list[Any]] = None  # `job_configs` of relax-train's command line (None: --entrypoint, --cfg, ...)
    checked = args.overrides  # what the checks here compose: with the plugins' conf/ directories (the job: its own)
    if args.entrypoint is None and exp_dir is not None and not exp_dir.startswith("/"):  # before the config's
        # check, which reads a relative -cp from it
        source = "--exp-dir" if args.exp_dir else EXP_DIR_ENV
        print(f"relax-submit: error: {source}={exp_dir}: must be an absolute directory on the cluster's shared "
              "storage (a relative one would be inside the job's temporary working_dir)", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    if args.entrypoint is None:
        from relax.config.store import PluginError, with_plugins

        # the job imports from its working_dir (its driver starts there; --exp-dir: on PYTHONPATH), so the check
        # here does too: `plugins=[mypkg.x]` living in --working-dir is found as the job would find it
        if str(working_dir) not in sys.path:
            sys.path.insert(0, str(working_dir))

        try:  # as relax-train does first: `plugins=[...]` may register the algorithm the config selects
            checked = with_plugins(args.overrides)
        except PluginError as exc:
            print(f"relax-submit: error: {exc}\nNothing was submitted.", file=sys.stderr)
            sys.exit(USAGE_EXIT)
        checked = check_config(checked, working_dir=working_dir, env=env, exp_dir=exp_dir)
        try:  # each job's config, composed once for the checks below, Relax's or a config of its own (-cp/-cn)
            configs = job_configs(checked, _hydra_conf(working_dir))
        except ValueError as exc:
            print(f"relax-submit: error: {exc}\nNothing was submitted.", file=sys.stderr)
            sys.exit(USAGE_EXIT)
        secrets = secret_env(configs or [])
        hidden |= set(secrets)
        for note in forward_secrets(env, secrets):
            print(f"relax-submit: note: {note}", file=sys.stderr)
    if args.entrypoint is not None:
        if args.exp_dir:
            parser.error("--exp-dir applies to relax-train, not to --entrypoint")
        exp_dir = None
    elif exp_dir is None:
        problems = storage_check(configs, sweep=_sweep(checked))
        if problems:
            print("relax-submit: error: in a Ray job relax-train starts in Ray's temporary copy of the working_dir, "
                  "deleted with the job; these would be written there and lost:\n"
                  + "\n".join(f"  {p}" for p in problems)
                  + f"\nUse --exp-dir DIR (or {EXP_DIR_ENV}=DIR), an absolute directory on storage the cluster's "
                  "nodes share: relax-train then runs in DIR and writes everything there. Or make each of the above "
                  "absolute. Nothing was submitted.", file=sys.stderr)
            sys.exit(USAGE_EXIT)
    if args.stop_grace_s is not None and args.stop_grace_s < 0:
        parser.error(f"--stop-grace-s {args.stop_grace_s}: must be a number of seconds >= 0")
    if STOP_WAIT_ENV not in env:  # `--env RAY_JOB_STOP_WAIT_TIME_S=...` wins
        grace = args.stop_grace_s
        if grace is None and configs:
            try:
                with job_environment(env):
                    grace = stop_grace_s(configs, sweep=_sweep(checked))
            except ValueError as exc:  # the job may still resolve it (a variable its nodes set): not refused
                print(f"relax-submit: note: the job's stop grace cannot be read here ({exc}), so `ray job stop` "
                      f"gives it Ray's default ({STOP_WAIT_ENV}, 3 s) before SIGKILL, which may cut its checkpoint: "
                      "pass --stop-grace-s SECONDS (or --env with the variable)", file=sys.stderr)
        if grace is not None:
            env[STOP_WAIT_ENV] = str(grace)
    payload = build_submission(args.overrides, working_dir=working_dir, env=env, entrypoint=args.entrypoint,
                               submission_id=args.submission_id, entrypoint_num_cpus=args.entrypoint_num_cpus,
                               exp_dir=exp_dir)
    if args.dry_run:
        import json

        print(json.dumps(shown_payload(payload, hidden), indent=2))
        return
    if not args.address:
        parser.error("--address is required (e.g. http://HEAD:8265), or set RAY_API_SERVER_ADDRESS")
    # the `ray job ...` commands printed below need RAY_AUTH_MODE=token too when it was turned on here only
    ray_cli = "RAY_AUTH_MODE=token ray" if "RAY_AUTH_MODE" not in os.environ and enable_token_auth() else "ray"
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(args.address)
        job_id = submit_with_retry(client, payload)
    except Exception as exc:  # noqa: BLE001 - connection refused, auth failure, bad runtime_env ...
        hint = ""
        if "://" not in args.address:  # Ray reads HOST:PORT as the GCS's address (ray start --port), not the dashboard
            hint = (f" ({args.address} without http:// is taken as the Ray head's GCS address, ray start's --port, "
                    f"6379 by default; the dashboard's is http://{args.address}, its port 8265 by default)")
        print(f"relax-submit: error: cannot submit to {args.address}: {type(exc).__name__}: {exc}{hint}",
              file=sys.stderr)
        sys.exit(USAGE_EXIT)
    print(f"submitted job {job_id} to {args.address}: {payload['entrypoint']}", flush=True)
    if exp_dir is not None:
        print(f"records, outputs and checkpoints: {exp_dir} (on the cluster)", flush=True)
    stop = f"{ray_cli} job stop --address {shlex.quote(args.address)} {job_id}"
    if STOP_WAIT_ENV in env:
        print(f"{stop}: SIGTERM, then up to {env[STOP_WAIT_ENV]} s for the job to stop ({STOP_WAIT_ENV}: relax-train "
              "finishes its step and commits a checkpoint) before Ray kills it", flush=True)
    if args.no_follow:
        print(f"follow it with: {ray_cli} job logs --address {shlex.quote(args.address)} --follow {job_id}")
        return
    try:
        status = follow_to_the_end(client, job_id)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on. Stop it with: {stop}", file=sys.stderr)
        sys.exit(130)
    except LostContact as exc:
        print(f"relax-submit: error: the cluster at {args.address} stopped answering while job {job_id} ran ({exc}); "
              f"its state is unknown here. Once the head is back: {ray_cli} job status --address "
              f"{shlex.quote(args.address)} {job_id}; a run stopped with it continues with train.resume=auto",
              file=sys.stderr)
        sys.exit(1)
    code = exit_code(client, job_id, status)
    print(f"job {job_id}: {status} (exit code {code})", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
