"""A sweep that a config file sets rather than the command line: `hydra: {mode: MULTIRUN, sweeper: {params: {seed:
1,2}}}` in a config of the user's own (`-cp <dir> -cn <name>`) or in an experiment file (`+experiment=...`, here from
a `-cd` directory). Hydra's main reads the composed config's hydra.mode (Hydra >= 1.2) and sweeps the params, while
relax-train's checks and relax-submit's read the command line alone: they judged a single run (the launcher's options
refused as a run's, a sweep's bad value found only when Hydra composed that job, a config of its own swept on Hydra's
basic launcher, relax-submit's storage check at hydra.run.dir while the sweep writes hydra.sweep.dir), and a file's
params in a run were ignored without a word. `relax.cli.command_line.config_sweep` gives such a sweep on the command
line as Hydra runs it (-m, and the params before the command line's overrides); params in a run are refused.
What Hydra's own main does with each config (its mode, and each job's overrides) is what the first test compares
against; the others run relax-train and relax-submit as a user does, in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra_inprocess import hydra_main
from omegaconf import OmegaConf

from relax.cli.command_line import sweeps
from relax.cli.config_check import MULTIRUN_FLAGS, sweep_jobs
from relax.cli.config_check import own_config as own_config_flags
from relax.config import conf_dir

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["train.num_rollout=1", "tracking.progress=false", "train.save=false", "tracking.enabled=false"]
SWEEP = {"mode": "MULTIRUN", "sweeper": {"params": {"seed": "1,2"}}}


def own_config(directory: Path, name: str, hydra: dict | None) -> Path:
    """A config of its own (a run's saved config, Relax's composed one) with `hydra` as its `hydra:` node."""
    from relax.config.compose import compose

    directory.mkdir(parents=True, exist_ok=True)
    data = OmegaConf.to_container(compose(QUIET))
    if hydra is not None:
        data["hydra"] = hydra
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return directory


def experiment(directory: Path, name: str, hydra: dict) -> Path:
    """An experiment file (`+experiment=<name>`) in `directory`/experiment that sets `hydra`."""
    (directory / "experiment").mkdir(parents=True, exist_ok=True)
    (directory / "experiment" / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump({"hydra": hydra}))
    return directory


def hydra_runs(args: list[str], where: Path) -> tuple[str, list[list[str]]]:
    """What Hydra's own main does with `relax-train <args>`: its mode and each job's overrides, in order, with
    Hydra's basic launcher in this process and a task that only records them."""
    seen: list[tuple[str, list[str]]] = []

    def task(_) -> None:
        seen.append((HydraConfig.get().mode.name, list(HydraConfig.get().overrides.task)))

    hydra_main([*args, "hydra/launcher=basic", f"hydra.run.dir={where / 'run'}",
                f"hydra.sweep.dir={where / 'sweep'}", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"],
               task)
    modes = {mode for mode, _ in seen}
    assert len(modes) == 1, seen
    return modes.pop(), [job for _, job in seen]


def mine(job: list[str]) -> list[str]:
    return [o for o in job if not o.startswith("hydra")]  # the test's own Hydra overrides aside


def test_relax_train_reads_a_config_files_sweep_as_hydra_runs_it(tmp_path: Path):
    from relax.cli.command_line import CommandLineError, config_sweep

    own = own_config(tmp_path / "own", "sweep", SWEEP)
    own_config(own, "mode", {"mode": "MULTIRUN"})
    own_config(own, "params", {"sweeper": {"params": {"seed": "1,2"}}})
    own_config(own, "plain", None)
    exp = experiment(tmp_path / "exp", "sweep", SWEEP)
    experiment(exp, "mode", {"mode": "MULTIRUN"})
    (exp / "experiment" / "plain.yaml").write_text("# @package _global_\nseed: 5\n")  # sets no sweep
    search = f"hydra.searchpath=[file://{exp}]"
    cases = [
        (["-cp", str(own), "-cn", "sweep", "train.lr=1e-4"], 2),
        (["-cp", str(own), "-cn", "mode", "seed=3,4,5"], 3),  # the mode from the file, the values from the command line
        (["-m", "-cp", str(own), "-cn", "params", "train.lr=1e-4,2e-4"], 4),  # -m given, the values from both
        (["-m", "-cp", str(own), "-cn", "params", "seed=7"], 1),  # the command line's value replaces the file's
        ([search, "+experiment=sweep"], 2),
        ([search, "+experiment=sweep", "seed=3"], 1),
        # a sweep over experiment files: Hydra composes its mode and sweeper without them (one job per file, whatever
        # one of them sets)
        (["-m", search, "+experiment=sweep,plain"], 2),
        # the controls: no sweep in the file, or the command line's hydra.mode=RUN over the file's MULTIRUN
        (["-cp", str(own), "-cn", "plain", "seed=3"], 1),
        (["-cp", str(own), "-cn", "mode", "hydra.mode=RUN"], 1),
        (["seed=3"], 1),
    ]
    for i, (args, n) in enumerate(cases):
        mode, jobs = hydra_runs(args, tmp_path / str(i))
        assert len(jobs) == n, (args, jobs)
        normal = config_sweep(args, conf_dir())
        assert sweeps(normal) == (mode == "MULTIRUN"), (args, mode, normal)
        if mode == "MULTIRUN":  # the jobs relax-train's checks read off the command line: Hydra's, in its order
            overrides = [a for a in own_config_flags(normal)[1] if a not in MULTIRUN_FLAGS]
            assert [mine(j) for j in sweep_jobs(overrides)] == [mine(j) for j in jobs], (args, overrides)
            # and given so, Hydra runs the same jobs
            assert hydra_runs(normal, tmp_path / f"{i}-normal") == (mode, jobs), (args, normal)
        else:
            assert normal == args
    # a sweep over experiment files without -m: Hydra refuses it (a run's ambiguous value), whatever a file sets; it
    # stays a run here too (the precheck names the value)
    args = [search, "+experiment=mode,plain"]
    assert config_sweep(args, conf_dir()) == args
    # a file's params in a run: Hydra ignores them without a word; refused
    for args in (["-cp", str(own), "-cn", "params"], [search, "+experiment=sweep", "hydra.mode=RUN"]):
        assert len(hydra_runs(args, tmp_path / "ignored")[1]) == 1
        with pytest.raises(CommandLineError, match=r"^hydra\.sweeper\.params \(seed=1,2\), set in the config, "
                                                   r"applies to sweeps only"):
            config_sweep(args, conf_dir())


def relax(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env = {k: v for k, v in env.items() if not k.startswith("RAY_") and k != "EXP_DIR"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env=env)


def test_relax_train_dry_runs_a_config_files_sweep_as_a_sweep(tmp_path: Path):
    """A config of its own that sets a sweep, with a launcher option: each job checked and dry-run on Relax's sweep
    launcher (before: the option refused as a run's, exit 2; without it, the jobs ran on Hydra's basic launcher)."""
    own = own_config(tmp_path / "own", "sweep", SWEEP)
    out = relax("relax.cli.train", ["-cp", str(own), "-cn", "sweep", "dry_run=true",
                                    "hydra.launcher.max_concurrent_jobs=1"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job 0 (seed=1 dry_run=True): dry run passed" in out.stdout, out.stdout
    assert "job 1 (seed=2 dry_run=True): dry run passed" in out.stdout, out.stdout
    assert "sweep dry run: 2 jobs, every job's config valid" in out.stdout, out.stdout


def test_a_config_files_sweep_gets_the_sweeps_checks_and_its_params_in_a_run_are_refused(tmp_path: Path):
    """An experiment file's sweep with a bad value: every job checked before any starts, the bad one named as the
    sweep numbers it (before: Hydra's 'Error merging override seed=abc' when it composed that job, exit 1). The
    same file's values in a run (hydra.mode=RUN): refused in one line (before: ignored, a run of the file's seed)."""
    exp = experiment(tmp_path / "exp", "bad", {"mode": "MULTIRUN", "sweeper": {"params": {"seed": "1,abc"}}})
    out = relax("relax.cli.train", ["-cd", str(exp), "+experiment=bad", "dry_run=true", *QUIET], tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("relax-train: error: invalid config in 1 of 2 sweep jobs (nothing started):\n"
                                 "job 1 (seed=abc +experiment=bad"), out.stderr
    out = relax("relax.cli.train", ["-cd", str(exp), "+experiment=bad", "hydra.mode=RUN", "dry_run=true", *QUIET],
                tmp_path)
    assert (out.returncode, out.stdout) == (2, ""), out.stdout + out.stderr
    assert out.stderr == ("relax-train: error: hydra.sweeper.params (seed=1,abc), set in the config, applies to sweeps "
                          "only: a run without -m ignores it (sweep with relax-train -m ..., or run once with "
                          "hydra.sweeper.params=null)\n")
    # as the message says: one run, of the file's other values
    out = relax("relax.cli.train", ["-cd", str(exp), "+experiment=bad", "hydra.mode=RUN", "hydra.sweeper.params=null",
                                    "dry_run=true", *QUIET], tmp_path)
    assert out.returncode == 0 and "dry run: config valid" in out.stdout + out.stderr, out.stdout + out.stderr


def test_relax_submit_checks_a_config_files_sweep_where_the_sweep_writes(tmp_path: Path):
    """relax-submit --dry-run of a config of its own that sets a sweep, with hydra.run.dir absolute and hydra.sweep.dir
    the default (relative: Ray's temporary copy of the working_dir): the sweep's directory is named (before: checked
    as a run's, hydra.run.dir, and submitted). The control: the same config without the sweep is submitted."""
    own_config(tmp_path / "work", "sweep", SWEEP)
    own_config(tmp_path / "work", "plain", None)
    absolute = ["tracking.uri=sqlite:////shared/mlflow.db", "hydra.run.dir=/shared/out"]
    out = relax("relax.cli.submit", ["--dry-run", "--working-dir", str(tmp_path / "work"), "--", "-cp", ".", "-cn",
                                     "sweep", *absolute], tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "hydra.sweep.dir=multirun/" in out.stderr and "Nothing was submitted." in out.stderr, out.stderr
    out = relax("relax.cli.submit", ["--dry-run", "--working-dir", str(tmp_path / "work"), "--", "-cp", ".", "-cn",
                                     "plain", *absolute], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["entrypoint"].endswith("-cp . -cn plain " + " ".join(absolute))


def test_relaxs_own_conf_sets_no_sweep():
    """`config_sweep` composes only where a file of the user's (or a plugin's) comes in (`SWEEP_FILE_KEYS`, a config
    of its own): Relax's own conf/ sets no hydra.mode and no sweeper params in any of its files."""
    from relax.cli.command_line import SWEEP_FILE_KEYS
    from relax.config.store import override_key

    setting = []
    for path in sorted(conf_dir().rglob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        hydra = data.get("hydra") if isinstance(data, dict) else None
        flat = {k for k in (data if isinstance(data, dict) else {}) if str(k).startswith("hydra.")}
        if (isinstance(hydra, dict) and ("mode" in hydra or "params" in (hydra.get("sweeper") or {}))) or \
                flat & {"hydra.mode", "hydra.sweeper.params"}:
            setting.append(path.relative_to(conf_dir()))
    assert setting == []
    assert [override_key(o) for o in ("+experiment=x", "++plugins=[a]", "hydra.searchpath=[d]", "experiment@e=x")] \
        == ["experiment", "plugins", "hydra.searchpath", "experiment"]
    assert {"experiment", "plugins", "hydra.searchpath"} <= set(SWEEP_FILE_KEYS)
