"""`relax-train`: Hydra's main around the runner. No logic beyond turning errors into messages."""

from __future__ import annotations

import sys
from pathlib import Path

from relax.cli.command_line import (
    CommandLineError,
    absolute_config_path,
    config_dir_searchpath,
    config_sweep,
    mode_flag,
    multirun_flag,
    own_config_launcher,
    searchpath_dirs,
    sweeps,
)
from relax.cli.config_check import MULTIRUN_FLAGS, own_config, problems
from relax.runner.errors import RunError

USAGE_EXIT = 2  # bad config or command line, as argparse does


def _fail(message: str, code: int = USAGE_EXIT) -> None:
    print(f"relax-train: error: {message}", file=sys.stderr)
    sys.exit(code)


class JobError(Exception):
    """A config or run error of one job of a sweep: raised (not exit) so the launcher records it and goes on."""


def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job_fail(message: str, code: int = USAGE_EXIT) -> None:
    """Single run: message on stderr, exit `code` (2; 1 for a run that trained nothing). Sweep job: raise JobError
    for the launcher's table (the job FAILED, the sweep's exit 1)."""
    if _in_sweep():
        raise JobError(message)
    _fail(message, code)


def _group_options(conf: Path) -> dict[str, list[str]]:
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(conf.iterdir())
        if d.is_dir() and any(d.glob("*.yaml"))
    }


def config_keys() -> list[str]:
    """The schema's top-level keys as `--help` lists them, in the schema's order: a section as `name.*` (with its own
    sections: `data.* (data.reward_service.*)`), a plain key by its name."""
    import dataclasses

    from relax.config.schema import RelaxConfig

    cfg, out = RelaxConfig(), []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value):
            out.append(f.name)
            continue
        inner = [f"{f.name}.{g.name}.*" for g in dataclasses.fields(value)
                 if dataclasses.is_dataclass(getattr(value, g.name))]
        out.append(f"{f.name}.*" + (f" ({', '.join(inner)})" if inner else ""))
    return out


def help_text(args: list[str] | None = None) -> str:
    """`relax-train --help`: with the options of the directories that `args` (its command line) add to Hydra's search
    path (a plugin's conf/, `-cd`, `hydra.searchpath`) among the config groups' options."""
    import textwrap

    from relax import algorithms
    from relax.config import conf_dir

    conf = conf_dir()
    lines = [
        "relax-train: RL post-training of language models, composed by Hydra.",
        "",
        "Usage: relax-train [GROUP=OPTION ...] [key=value ...] [dry_run=true]",
        "       relax-train -m GROUP=A,B key=1,2 ...      (sweep: one job per combination)",
        "",
        "Config groups (default in brackets):",
    ]
    defaults = {"algorithm": "grpo", "model": "tiny", "teacher": "none", "reward_model": "none", "cluster": "local",
                "rollout": "embedded", "data": "digits"}
    groups = _group_options(conf)
    for directory in searchpath_dirs(list(args or [])):  # a group of Relax's, or one of the directory's own
        for group, options in _group_options(directory).items():
            groups[group] = sorted({*groups.get(group, []), *options})
    width = max(map(len, groups), default=0)
    for group, options in groups.items():
        shown = [f"[{o}]" if o == defaults.get(group) else o for o in options]
        lines.append(f"  {group:<{width}} {', '.join(shown)}")
    lines += ["", "Algorithms:"]
    for name in algorithms.names():
        lines.append(f"  {name:<22} {algorithms.get(name).summary}")
    lines += [
        "",
        textwrap.fill(f"Keys: {', '.join(config_keys())}.", width=100, subsequent_indent="      "),
        "  relax-train --cfg job               print the composed config",
        "  relax-train ... dry_run=true        validate, print the plan, run every check a start runs before Ray",
        "                                      (model files, tokenizer, data, checkpoints, ...); start nothing",
        "  relax-train ... train.resume=auto   continue from the last checkpoint of this experiment and run name",
        "                                      (checkpoints/<tracking.experiment>/<run name>, same MLflow run)",
        "  relax-train -cp <checkpoint> -cn config train.resume=<checkpoint> train.num_rollout=0",
        "                                      evaluate a checkpoint with its run's own config (its config.yaml);",
        "                                      a path holding '=' (a sweep job's) is quoted for Hydra as a value:",
        "                                      \"train.resume='checkpoints/x/algorithm=grpo-seed1/step_000002'\"",
        "  relax-train plugins=[mypkg.algos] algorithm=mine",
        "                                      import modules of your own first (they register algorithms; a conf/",
        "                                      beside one adds YAML options): docs/adding-an-algorithm.md",
        "  relax-train --hydra-help            Hydra's own flags",
        f"Config files: {conf}",
    ]
    return "\n".join(lines)


def _precheck(args: list[str]) -> None:
    """Compose and validate before Hydra's main runs (each job of a sweep; composition only for --cfg), so that
    every mistake is one clear message (exit 2) before anything starts."""
    given = list(dict.fromkeys(flag for a in args if (flag := mode_flag(a)) is not None))
    if len(given) > 1:
        _fail(f"{' and '.join(given)} cannot be given together: Hydra does one of them (to see a sweep job's config, "
              "give that job's values with --cfg job, without -m)")
    message = problems(args)
    if message is not None:
        _fail(message)


def output_dir_problem(args: list[str], conf: Path) -> str | None:
    """Why Hydra could not make the output directory of `relax-train <args>` (`hydra.run.dir`; a sweep's
    `hydra.sweep.dir`), which it makes before Relax runs (a dry run's too) and fails on with a traceback: its nearest
    existing directory cannot be written (a read-only working directory, whose `outputs/...` is the default). One
    line naming the key to set; None when it can be made, or when that is not known here (a flag Hydra answers, a
    config that does not compose: the precheck or Hydra names that). Tried by creating a file, as the checkpoint
    directory's check does (`relax.writable`): permission bits say yes to root and nothing of a read-only
    filesystem."""
    from omegaconf import OmegaConf

    from relax.cli.config_check import sweep_jobs
    from relax.config.compose import compose
    from relax.writable import nearest_existing, try_writing

    where, rest = own_config(args)
    path = where.get("path")
    if path is not None and (not path or "://" in path):
        return None
    rest = multirun_flag(rest)
    sweep = sweeps(rest)
    plain = [a for a in rest if a not in MULTIRUN_FLAGS]
    if any(a.startswith("-") for a in plain):  # --cfg, --info, ...: no job runs, or Hydra answers the flag
        return None
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    try:
        job = sweep_jobs(plain)[0] if sweep else plain  # a sweep's directory is its first job's (the same for all)
        composed = compose(job, config_name=where.get("name") or "config", conf=Path(path) if path else conf,
                           hydra=True)
        directory = OmegaConf.select(composed, key)
    except Exception:  # noqa: BLE001 - Hydra's and OmegaConf's own errors: Hydra's main names them as before
        return None
    if not directory:
        return None
    # a relative one: from the working directory (hydra.job.chdir)
    existing = nearest_existing(Path(str(directory)).expanduser())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        try_writing(existing)
    except OSError as exc:
        why = exc.strerror if exc.strerror else str(exc)
        return (f"{key}={directory}: Hydra's output directory (the job's resolved config and log) cannot be made, "
                f"{existing.absolute()} is not writable ({why}); set {key}=<a writable directory>")
    return None


def _run(dc) -> object:
    """Hydra's task function; returns the runner's result (a sweep's table shows its final reward)."""
    from hydra.core.hydra_config import HydraConfig

    from relax.cli.config_check import duplicate_problems, invalid_config, launcher_problems
    from relax.config import ConfigError, to_relax_config

    # a run that the precheck leaves to Hydra (a flag it does not check: --info, a `pkg://` -cp, ...): a key
    # its command line gives twice, and its launcher options (which a run without -m ignores), are refused here too
    found = duplicate_problems(list(HydraConfig.get().overrides.task),
                               command="sweep" if _in_sweep() else "run")[0]
    found += [] if _in_sweep() else launcher_problems(list(HydraConfig.get().overrides.hydra), sweep=False)
    try:  # the command line's overrides (this job's, in a sweep): what it set, beside a reused run's saved config
        cfg = to_relax_config(dc, overrides=list(HydraConfig.get().overrides.task))
    except ConfigError as exc:
        found += exc.violations
    if found:
        _job_fail(invalid_config(found))
    from relax.runner.plan import build_plan

    plan = build_plan(cfg)
    if cfg.dry_run:  # every check a start runs before Ray (relax.runner.preflight), changing nothing
        from relax.runner.preflight import preflight
        from relax.runner.summary import config_summary

        print(config_summary(cfg))
        print()
        print(plan.render())
        checked = preflight(cfg, plan)
        print()
        print(checked.render(), flush=True)
        if not checked.ok:
            _job_fail(f"dry run: a start would stop before Ray: {checked.error()}")
            return None
        print("\ndry run: config valid, and every check a start runs before Ray passed; nothing started.")
        return None
    from relax.data.datasets import DataError
    from relax.models.checkpoint_files import CheckpointFileError
    from relax.rewards.calls import RewardSpecError
    from relax.rollout.sglang.process import StartupError
    from relax.runner.train import run

    try:
        return run(cfg, plan, output_dir=Path(HydraConfig.get().runtime.output_dir), dictconfig=dc)
    # DataError: a resume whose prompts differ from the checkpoint's; RewardSpecError: a reward, tool or agent
    # function that its worker processes cannot load (its `prepare` raised: the message holds that traceback)
    except (RunError, DataError, RewardSpecError) as exc:  # NothingTrained (a RunError): exit 1, its summary printed
        _job_fail(str(exc), getattr(exc, "exit_code", USAGE_EXIT))
    except StartupError as exc:  # a server process of the run (the router, an engine) that never became healthy
        _job_fail(str(exc))
    except CheckpointFileError as exc:  # a role refused a checkpoint file (on Ray: the cause of a RayTaskError)
        _job_fail(str(getattr(exc, "cause", exc)))
    return None


def stopped_text(exc: BaseException, sweep: bool = False) -> str:
    """What an interrupt stopped, for relax-train's last line: on a cluster the run (or sweep) joined
    (`exc.joined`, set by the runner and the sweep launcher), only its own processes, the cluster keeps running;
    otherwise the Ray instance it started, with every process in it."""
    joined = getattr(exc, "joined", None)
    if joined:
        what = "the sweep's jobs and their Ray actors" if sweep else "the run's Ray actors"
        return f"{what} stopped (the Ray cluster at {joined} keeps running), the MLflow run is marked KILLED"
    return "Ray and its processes stopped, the MLflow run is marked KILLED"


def main() -> None:
    try:  # -cd DIR: given as Hydra's hydra.searchpath, which relax-train's check reads (and Hydra the same)
        sys.argv[1:] = config_dir_searchpath(absolute_config_path(sys.argv[1:]))
    except CommandLineError as exc:
        _fail(str(exc))
    args = sys.argv[1:]
    from relax.config.store import PluginError, with_plugins

    try:  # the user's modules first: they may register the algorithm (and its `<name>_schema`) the config selects;
        # their conf/ directories' YAML options join the search path, for Hydra's main and the check below alike
        sys.argv[1:] = args = with_plugins(args)
    except PluginError as exc:
        _fail(str(exc))
    if any(a in ("-h", "--help") for a in args):
        print(help_text(args))
        return
    from relax.config import conf_dir, register_configs

    try:
        conf = conf_dir()
    except FileNotFoundError as exc:
        _fail(str(exc))
    register_configs()
    sys.argv[1:] = args = multirun_flag(args)  # a sweep by hydra.mode=MULTIRUN: -m, for every check below and Hydra
    try:  # a sweep that a config file sets (hydra.mode: MULTIRUN, hydra.sweeper.params): on the command line too
        sys.argv[1:] = args = config_sweep(args, conf)
    except CommandLineError as exc:
        _fail(str(exc))
    _precheck(args)  # a Hydra flag other than -m, --cfg, -cp and -cn (--info, ...): left to Hydra
    sys.argv[1:] = args = own_config_launcher(args, conf)
    if (problem := output_dir_problem(args, conf)) is not None:
        _fail(problem)

    import hydra

    from relax.runner.preempt import Preempted, Signalled

    try:
        hydra.main(config_path=str(conf), config_name="config", version_base=None)(_run)()
    except Preempted as exc:  # Ctrl-C or SIGTERM during the run: exit 128 + the signal (130, 143)
        text = stopped_text(exc)
        print(f"relax-train: {exc}. {text[:1].upper()}{text[1:]}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except Signalled as exc:  # SIGTERM to a sweep's driver: its jobs stopped as on Ctrl-C (the table above says how)
        print(f"\nrelax-train: {exc}: interrupted; {stopped_text(exc, sweep=True)}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:  # Ctrl-C outside the run (composing the config, starting), or on a sweep's driver
        print(f"\nrelax-train: interrupted; {stopped_text(exc, sweep=sweeps(args))}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
