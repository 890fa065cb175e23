"""Hydra's flags on relax-train's (and relax-submit's) command line, beside the overrides:
- `-cd DIR` / `--config-dir DIR` reaches relax-train's own config check, given as Hydra's
  equivalent `hydra.searchpath=[file://DIR]` (`relax.cli.command_line.config_dir_searchpath`); before, the check left
  any command line with a flag it does not read to Hydra (its raw "Could not override" text, exit 1).
- An override relax-train adds (a plugin's conf/ on `hydra.searchpath`, Relax's sweep launcher) joins the user's
  block of overrides (`relax.config.store.with_override`); before, it was appended after `--cfg job` / `--info`, and
  Hydra's parser refused it as an "unrecognized argument" the user never typed.
- relax-submit reads `hydra.mode=MULTIRUN` as a sweep, as relax-train does (`relax.cli.command_line.sweeps`).
- A relative `data.path` that is missing under `hydra.job.chdir=true` says where it was looked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra._internal.utils import get_args_parser
from hydra_inprocess import hydra_main
from relax_train_inprocess import relax_train

from tests.cli.test_plugins import write_plugin

ABSOLUTE = ["tracking.uri=sqlite:////shared/mlflow.db", "train.save_dir=/shared/ckpt", "hydra.run.dir=/shared/out"]


def model_dir(root: Path, **options: int) -> Path:
    """`root` with model/<option>.yaml for each option, each setting model.hidden_size to its value."""
    (root / "model").mkdir(parents=True)
    for name, hidden in options.items():
        (root / "model" / f"{name}.yaml").write_text(f"# @package _global_\nmodel:\n  name: tiny\n  hidden_size: "
                                                     f"{hidden}\n")
    return root


def hydras_hidden_size(args: list[str], where: Path) -> int:
    """model.hidden_size of the config Hydra's own main composes for `relax-train <args>` (its -cd read by Hydra),
    with a task that only records it."""
    seen: list[int] = []
    extra = ["hydra/launcher=basic", f"hydra.run.dir={where}", "hydra/job_logging=disabled",
             "hydra/hydra_logging=disabled"]
    at = next(i for i, a in enumerate(args) if "=" in a and not a.startswith("-"))  # beside the overrides
    hydra_main([*args[:at], *extra, *args[at:]], lambda cfg: seen.append(cfg.model.hidden_size))
    (hidden,) = seen
    return hidden


def test_config_dir_reaches_relax_trains_check(tmp_path, capfd, monkeypatch):
    """docs/adding-an-algorithm.md: `-cd /abs/dir` (`--config-dir`) reaches relax-train's own config check. The same
    mistakes get the check's one line (exit 2) as without -cd; before: Hydra's text, exit 1."""
    mine = model_dir(tmp_path / "mine", mytiny=48)
    monkeypatch.chdir(tmp_path)
    code, _, err = relax_train(["-cd", str(mine), "train.lrr=1"], capfd)
    assert code == 2, err
    assert err.strip() == ("relax-train: error: invalid config (1 problem):\n"
                           "  - unknown key train.lrr (did you mean train.lr?)")
    code, _, err = relax_train(["--config-dir=mine", "algorithm=grpoo"], capfd)  # relative: from the cwd
    assert code == 2, err
    assert "- algorithm=grpoo: config group algorithm has no option 'grpoo' (did you mean algorithm=grpo?)" in err
    assert "Traceback" not in err and "_schema" not in err
    # the directory's own option still composes, as Hydra's -cd composes it
    code, out, err = relax_train(["--config-dir", "mine", "model=mytiny", "--cfg", "job"], capfd)
    assert code == 0, err
    assert "  hidden_size: 48\n" in out


def test_config_dir_is_searched_where_hydra_searches_it(tmp_path):
    """Hydra puts the -cd directory after the primary config's directory and before hydra.searchpath's entries; the
    rewrite keeps that order. Checked against Hydra's own main reading the -cd flag itself: an option in both conf/
    and the -cd directory is conf/'s, one in both the -cd directory and a hydra.searchpath directory is -cd's."""
    from relax.cli.command_line import config_dir_searchpath

    cd = model_dir(tmp_path / "cd", tiny=40, mytiny=48)
    other = model_dir(tmp_path / "other", mytiny=56)
    searchpath = f"hydra.searchpath=[file://{other}]"
    for args in (["-cd", str(cd), "model=mytiny", searchpath], ["-cd", str(cd), "model=tiny"],
                 [f"--config-dir={cd}", "model=mytiny"], [searchpath, "model=mytiny", "-cd", str(cd)]):
        rewritten = config_dir_searchpath(args)
        assert not any(a.startswith("-") for a in rewritten), rewritten
        assert hydras_hidden_size(rewritten, tmp_path / "a") == hydras_hidden_size(args, tmp_path / "b"), args
    assert hydras_hidden_size(["-cd", str(cd), "model=mytiny", searchpath], tmp_path / "c") == 48  # not vacuous
    assert hydras_hidden_size(["-cd", str(cd), "model=tiny"], tmp_path / "d") == 64
    # a primary config (-cn) that only the -cd directory has: Hydra finds it there, and reads a hydra.searchpath only
    # after the primary config, so -cd is left to Hydra (relax-train's check leaves that command line to Hydra)
    (cd / "myexp.yaml").write_text("defaults:\n  - config\n  - _self_\nmodel:\n  hidden_size: 72\n")
    args = ["-cd", str(cd), "-cn", "myexp", "seed=1"]
    assert config_dir_searchpath(args) == args
    assert hydras_hidden_size(args, tmp_path / "e") == 72
    # the control: -cn config, which conf/ has, is the rewritten form
    assert config_dir_searchpath(["-cd", str(cd), "-cn", "config", "seed=1"]) == [
        "-cn", "config", "seed=1", f"hydra.searchpath=['file://{cd}']"]


def test_a_config_dir_that_is_not_there_or_given_twice_is_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    code, _, err = relax_train(["-cd", "nope", "seed=1"], capfd)
    assert code == 2, err
    assert err.strip() == (f"relax-train: error: -cd nope: {tmp_path / 'nope'} is not a directory (-cd/--config-dir "
                           "adds a directory of YAML options to Hydra's search path)")
    code, _, err = relax_train(["--config-dir=", "seed=1"], capfd)  # no directory: not "the working directory"
    assert code == 2 and err.strip() == ("relax-train: error: --config-dir=: no directory given (-cd/--config-dir adds "
                                         "a directory of YAML options to Hydra's search path)"), err
    code, _, err = relax_train(["-cd", "a", "--config-dir=a", "seed=1"], capfd)
    assert code == 2, err
    assert err.startswith("relax-train: error: -cd a and --config-dir=a: -cd/--config-dir is given 2 times and Hydra "
                          "reads the last alone: give it once") and len(err.strip().splitlines()) == 1


# (command line, what Hydra's parser must read as its overrides once `x=1` is added)
ADDED = [
    (["seed=1", "--cfg", "job"], ["seed=1", "x=1"]),
    (["seed=1", "y=2", "--info", "searchpath"], ["seed=1", "y=2", "x=1"]),
    (["seed=1", "--info"], ["seed=1", "x=1"]),
    (["--cfg", "job", "seed=1"], ["seed=1", "x=1"]),
    (["-m", "-cp", "/ck", "-cn", "config", "seed=1,2"], ["seed=1,2", "x=1"]),
    (["-m", "-cp", "/ck", "-cn", "config", "seed=1,2", "--resolve", "-p", "model"], ["seed=1,2", "x=1"]),
    (["-m", "-cp", "/ck", "-cn", "config"], ["x=1"]),
    (["--info"], ["x=1"]),
    (["--cfg", "hydra"], ["x=1"]),
    ([], ["x=1"]),
]


@pytest.mark.parametrize(("args", "overrides"), ADDED)
def test_an_added_override_joins_the_users_block_as_hydras_parser_reads_it(args, overrides):
    """Hydra's own argparse parser reads the result: nothing unrecognized, the flags' values kept as they were."""
    from relax.config.store import with_override, with_search_path

    added = with_override(args, "x=1")
    parsed = get_args_parser().parse_args(added)
    assert parsed.overrides == overrides
    assert vars(parsed) == {**vars(get_args_parser().parse_args(args)), "overrides": overrides}
    # the plugins' search path, and a -cd directory (first), the same way
    line = "hydra.searchpath=['file:///p/conf']"
    assert get_args_parser().parse_args(with_search_path(args, [Path("/p/conf")])).overrides == [
        line if o == "x=1" else o for o in overrides]


def test_a_plugins_conf_directory_leaves_flags_after_the_overrides_working(tmp_path, capfd, monkeypatch):
    """A plugin with a conf/ directory (docs/adding-an-algorithm.md) and a flag written after the overrides, as
    Hydra users write it: before, "unrecognized arguments: hydra.searchpath=[...]" (exit 2, the usage text)."""
    write_plugin(tmp_path, "flagplug", "flagtoy")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    # --info in a process of its own: Hydra prints it through log handlers that an earlier main in this one has set
    info = subprocess.run([sys.executable, "-m", "relax.cli.train", "plugins=[flagplug.register]", "algorithm=flagtoy",
                           "--info", "searchpath"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert info.returncode == 0, info.stderr
    assert f"file://{(tmp_path / 'flagplug' / 'conf').resolve()}" in info.stdout
    code, out, err = relax_train(["plugins=[flagplug.register]", "algorithm=flagtoy", "--cfg", "job"], capfd)
    assert code == 0, err
    assert "  name: flagtoy\n" in out and "  scale: 0.5\n" in out  # the plugin's conf/algorithm/flagtoy.yaml
    # with -cd too: its directory first, the plugin's after it, as Hydra would search them
    mine = model_dir(tmp_path / "mine", mytiny=48)
    code, out, err = relax_train(["plugins=[flagplug.register]", "algorithm=flagtoy", "model=mytiny", "-cd", "mine",
                                  "--cfg", "job"], capfd)
    assert code == 0, err
    assert "  scale: 0.5\n" in out and "  hidden_size: 48\n" in out
    from relax.cli.command_line import config_dir_searchpath

    assert config_dir_searchpath(["plugins=[x]", "-cd", str(mine), "hydra.searchpath=[file:///p]"]) == [
        "plugins=[x]", f"hydra.searchpath=['file://{mine}','file:///p']"]


@pytest.fixture
def jobs(monkeypatch):
    import ray.job_submission

    from relax.cli import submit
    from tests.cli.jobs_stub import Jobs

    for name in ("EXP_DIR", "RAY_JOB_STOP_WAIT_TIME_S", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Jobs)
    monkeypatch.setattr(submit, "enable_token_auth", lambda: False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return submit


def submitted(submit, capsys, *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        submit.main(["--dry-run", *argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_relax_submit_reads_hydra_mode_multirun_as_a_sweep(jobs, capsys):
    """As -m: its jobs checked one by one (before: `seed=1,2` composed as one run's value, refused), its output
    directory hydra.sweep.dir (a relative one refused), its stop grace a sweep's."""
    for mode in (["-m"], ["hydra.mode=MULTIRUN"], ["++hydra.mode=MULTIRUN"]):
        code, out, err = submitted(jobs, capsys, "--", *mode, "seed=1,2", *ABSOLUTE)
        assert code == 2, (mode, out)
        assert "hydra.sweep.dir=multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}: relative" in err, (mode, err)
        code, out, err = submitted(jobs, capsys, "--", *mode, "seed=1,2", *ABSOLUTE, "hydra.sweep.dir=/shared/m")
        assert code == 0, (mode, err)
        assert json.loads(out)["runtime_env"]["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == str(120 + 120)  # a sweep's
    # the control: a run (hydra.mode=RUN) writes no hydra.sweep.dir, and stops as a run does
    code, out, err = submitted(jobs, capsys, "--", "hydra.mode=RUN", "seed=1", *ABSOLUTE)
    assert code == 0, err
    assert json.loads(out)["runtime_env"]["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == str(300 + 1800 + 120)


def test_relax_submit_checks_a_config_dir_as_the_job_reads_it(jobs, capsys, tmp_path):
    """`-cd DIR` relative to the job's working_dir (where its relax-train starts), checked here before submitting;
    the submitted command keeps it as typed (the job's relax-train reads it)."""
    work = tmp_path / "work"
    model_dir(work / "mine", mytiny=48)
    code, _, err = submitted(jobs, capsys, "--working-dir", str(work), "--", "-cd", "mine", "train.lrr=1", *ABSOLUTE)
    assert code == 2
    assert "unknown key train.lrr (did you mean train.lr?)" in err
    code, out, err = submitted(jobs, capsys, "--working-dir", str(work), "--", "-cd", "mine", "model=mytiny",
                               *ABSOLUTE)
    assert code == 0, err
    assert json.loads(out)["entrypoint"].endswith("-cd mine model=mytiny " + " ".join(ABSOLUTE))
    code, _, err = submitted(jobs, capsys, "--working-dir", str(work), "--", "-cd", "nope", "seed=1", *ABSOLUTE)
    assert code == 2
    assert "-cd nope: a relative config directory is read from the job's copy of the working_dir" in err


def test_a_missing_relative_data_path_under_job_chdir_says_where_it_was_read(tmp_path, capfd, monkeypatch):
    """hydra.job.chdir=true makes the job's output directory the working directory: a relative data.path is read
    there, not where relax-train started, and the message says so and gives the path that exists."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "words.jsonl").write_text('{"prompt": "hi", "label": "1"}\n')
    run_dir = tmp_path / "run"
    args = ["hydra.job.chdir=true", f"hydra.run.dir={run_dir}", "data=jsonl", "data.reward=digits", "dry_run=true"]
    code, _, err = relax_train([*args, "data.path=words.jsonl"], capfd)
    assert code == 2, err
    assert (f"data file words.jsonl does not exist (a relative path is read from the job's directory {run_dir}, not "
            f"from {tmp_path} where relax-train started, because hydra.job.chdir=true: give an absolute path, e.g. "
            f"{tmp_path / 'words.jsonl'})") in err
    # the control: without hydra.job.chdir the same path is found
    code, _, err = relax_train([*args[1:], "data.path=words.jsonl"], capfd)
    assert "words.jsonl" not in err, err


def test_help_lists_the_options_of_the_directories_on_the_search_path(tmp_path, capfd, monkeypatch):
    """`--help`'s "Config groups" lists the options Hydra would find: a -cd / hydra.searchpath directory's and a
    plugin's conf/ beside conf/'s (the algorithm table listed the plugin's algorithm, the groups line did not)."""
    write_plugin(tmp_path, "helpplug", "helptoy")
    monkeypatch.syspath_prepend(str(tmp_path))
    model_dir(tmp_path / "mine", mytiny=48)
    (tmp_path / "mine" / "mygroup").mkdir()
    (tmp_path / "mine" / "mygroup" / "one.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)

    def groups(*args: str) -> dict[str, list[str]]:
        code, out, err = relax_train([*args, "--help"], capfd)
        assert code in (0, None), err
        block = out.split("Config groups (default in brackets):\n", 1)[1].split("\n\n", 1)[0]
        return {line.split()[0]: line.split(None, 1)[1].split(", ") for line in block.splitlines()}

    plain = groups()
    assert "mytiny" not in plain["model"] and "helptoy" not in plain["algorithm"] and "mygroup" not in plain
    for given in (["-cd", "mine"], [f"hydra.searchpath=[file://{tmp_path / 'mine'}]"]):
        shown = groups(*given)
        assert set(shown["model"]) == {*plain["model"], "mytiny"}, given  # "[tiny]": the default, marked
        assert shown["mygroup"] == ["one"] and shown["algorithm"] == plain["algorithm"]
    assert set(groups("plugins=[helpplug.register]")["algorithm"]) == {*plain["algorithm"], "helptoy"}


@pytest.mark.parametrize("args, says", [
    (["-m", "seed=1,2", "--cfg", "job"], "-m and --cfg cannot be given together"),
    (["--cfg", "job", "seed=1", "--info"], "--cfg and --info cannot be given together"),
    # the forms argparse reads too: Hydra's --run, a long flag's =value, a short flag's attached value
    (["-r", "seed=1", "--cfg", "job"], "--run and --cfg cannot be given together"),
    (["--cfg=job", "-m", "seed=1,2"], "--cfg and -m cannot be given together"),
    (["-cjob", "seed=1", "--info"], "--cfg and --info cannot be given together"),
    (["--info=config", "-m", "seed=1,2"], "--info and -m cannot be given together"),
])
def test_flags_that_each_choose_what_hydra_does_are_refused_together_in_one_line(tmp_path, capfd, monkeypatch,
                                                                                 args, says):
    """Hydra's main does one of -m, --cfg, --info, --shell-completion; given two, it raised a ValueError with its
    traceback ("Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified"). The control:
    --cfg alone prints the config."""
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train(args, capfd)
    assert code == 2 and err.strip().startswith(f"relax-train: error: {says}: Hydra does one of them"), err
    assert "Traceback" not in err
    code, out, err = relax_train(["seed=1", "--cfg", "job"], capfd)
    assert code == 0 and "algorithm:" in out, err
