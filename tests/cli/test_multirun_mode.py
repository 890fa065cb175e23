"""`hydra.mode=MULTIRUN` on relax-train's command line: Hydra (>= 1.2) sweeps on it as on -m, and relax-train's checks
read it as a sweep too (`relax.cli.command_line.sweeps`, the one answer; `multirun_flag` gives it to them as -m).
Before, relax-train decided run or sweep from -m alone: its precheck composed a sweep's values as one run's (`seed=1,2`:
Hydra's "Ambiguous value"), refused the launcher's options as a run's, and checked Hydra's output directory at
hydra.run.dir while Hydra made hydra.sweep.dir (the read-only case: tests/faults/test_unwritable_dirs.py)."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra_inprocess import hydra_main

from relax.cli.command_line import multirun_flag, sweeps
from relax.cli.config_check import problems
from relax.cli.train import output_dir_problem
from relax.config import conf_dir

# each way of giving Hydra's run mode, beside -m (Hydra's own verdict on each is what the test compares against)
COMMAND_LINES = [
    ["hydra.mode=MULTIRUN", "seed=1"],
    ["seed=1", "hydra.mode=MULTIRUN"],
    ["++hydra.mode=MULTIRUN", "seed=1"],
    ["+hydra.mode=MULTIRUN", "seed=1"],
    ["hydra.mode='MULTIRUN'", "seed=1"],
    ["-m", "hydra.mode=MULTIRUN", "seed=1"],
    ["-m", "hydra.mode=RUN", "seed=1"],
    ["-m", "seed=1"],
    ["hydra.mode=RUN", "seed=1"],
    ["hydra.mode=null", "seed=1"],
    ["seed=1"],
]


def hydra_mode(args: list[str], where: Path) -> str:
    """How Hydra's own main runs `relax-train <args>` (RUN or MULTIRUN, as the job sees it in HydraConfig), with
    Hydra's basic launcher in this process and a task that only records it."""
    seen: list[str] = []

    def task(_) -> None:
        seen.append(HydraConfig.get().mode.name)

    hydra_main([*args, "hydra/launcher=basic", f"hydra.run.dir={where / 'run'}", f"hydra.sweep.dir={where / 'sweep'}",
                "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"], task)
    (mode,) = seen
    return mode


def test_relax_train_sweeps_where_hydra_does(tmp_path: Path):
    for i, args in enumerate(COMMAND_LINES):
        mode = hydra_mode(args, tmp_path / str(i))
        assert sweeps(args) == (mode == "MULTIRUN"), (args, mode)
        # the form relax-train hands on to its checks and to Hydra (a sweep as -m) is the same to Hydra
        normal = multirun_flag(args)
        if normal != args:
            assert hydra_mode(normal, tmp_path / f"{i}-handed-on") == mode, (args, normal)
        assert ("-m" in normal) == (mode == "MULTIRUN"), normal


def test_what_is_not_read_as_a_sweep_is_left_as_given():
    # another flag (--cfg prints the config; with -m Hydra would refuse it), a mode given twice (the precheck names
    # that), RUN: as given
    for args in (["--cfg", "job", "hydra.mode=MULTIRUN"], ["hydra.mode=MULTIRUN", "hydra.mode=MULTIRUN"],
                 ["hydra.mode=RUN", "seed=1"], ["-cp", "hydra.mode=MULTIRUN", "-cn", "config", "seed=1"]):
        assert multirun_flag(args) == args
    # the -cp directory and -cn name are kept with their flags; -m goes first, before the overrides' one block
    assert multirun_flag(["-cp", "/ck", "-cn", "config", "seed=1,2", "hydra.mode=MULTIRUN", "train.lr=1e-5"]) == [
        "-m", "-cp", "/ck", "-cn", "config", "seed=1,2", "train.lr=1e-5"]


def test_the_precheck_reads_hydra_mode_multirun_as_a_sweep():
    """A sweep's values and its launcher's options, given with hydra.mode=MULTIRUN: what the precheck says of them
    is what it says with -m (nothing: valid)."""
    sweep = ["seed=1,2", "hydra.launcher.max_concurrent_jobs=2", "train.save=false", "tracking.enabled=false"]
    assert problems(["-m", *sweep]) is None
    assert problems(multirun_flag(["hydra.mode=MULTIRUN", *sweep])) is None
    # without it (a run): the same values are refused, as before
    assert problems(sweep) is not None


def test_a_sweeps_output_directory_is_checked_at_hydra_sweep_dir(tmp_path: Path):
    """output_dir_problem of a sweep given with hydra.mode=MULTIRUN looks at hydra.sweep.dir, not at hydra.run.dir:
    a file where the sweep's directory would be is named (and the run's directory, which can be made, is not)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["hydra.mode=MULTIRUN", "seed=1", f"hydra.sweep.dir={blocker}/out", f"hydra.run.dir={tmp_path}/run",
            "train.save=false", "tracking.enabled=false"]
    problem = output_dir_problem(args, conf_dir())
    assert problem is not None and problem.startswith(f"hydra.sweep.dir={blocker}/out: "), problem
    assert problem.endswith("set hydra.sweep.dir=<a writable directory>"), problem
    # the same command line as a run: its run directory can be made
    assert output_dir_problem(["hydra.mode=RUN", *args[1:]], conf_dir()) is None
