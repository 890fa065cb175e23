"""`relax-train -m ... dry_run=true` does for every job what a single run's dry run does, and starts nothing: each
job is composed and checked (the launcher's precheck), its summary, plan and checks printed, then one line per job;
no Ray, no MLflow run, no checkpoint directory. And an evaluation-only sweep of a run's saved config (`-cp <checkpoint>
-cn config train.num_rollout=0`, docs/training.md "Evaluation") is checked with each job's own overrides, as the job
itself is. In process, with the sweep's Ray start and parent run replaced by exits: seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from relax_train_inprocess import relax_train

from relax.config import load_config

SMALL = ["train.num_rollout=1", "tracking.progress=false"]
RAY_STARTED, PARENT_STARTED = 98, 99


@pytest.fixture
def sweep(tmp_path, monkeypatch, capfd):
    """`relax-train -m ARGS` in tmp_path; starting the sweep's Ray exits 98, its MLflow parent run 99."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.relax_ray_launcher import launcher

    Plugins.instance()  # Hydra's first scan of its plugins loads the launcher's module again: scanned before the patch

    def ray(self):
        raise SystemExit(RAY_STARTED)

    def parent(self):
        raise SystemExit(PARENT_STARTED)

    monkeypatch.setattr(launcher.RelaxRayLauncher, "_init_ray", ray)
    monkeypatch.setattr(launcher.RelaxRayLauncher, "_start_parent", parent)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        return relax_train(["-m", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}"], capfd)

    return run


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=relax_ray"]], ids=["default", "relax_ray"])
def test_a_sweeps_dry_run_checks_every_job_and_starts_nothing(sweep, tmp_path: Path, launcher):
    code, out, err = sweep(*launcher, "seed=1,2", "dry_run=true", *SMALL)
    assert code == 0, out + err
    # each job's own dry run: its summary, plan and checks, and the dry run's last line
    assert out.count("dry run: config valid, and every check a start runs before Ray passed; nothing started.") == 2
    # the Ray the sweep would run each job on, as a sweep job's plan says it (not a Ray of the job's own)
    assert out.count("the sweep's Ray instance (local, started by the sweep launcher for its jobs)") == 2
    assert "sweep dry run: 2 jobs, every job's config valid and every check a start runs before Ray passed; " \
           "nothing started (no Ray, no MLflow run, no checkpoint directory)" in out
    assert "job 0 (seed=1 dry_run=True train.num_rollout=1 tracking.progress=False): dry run passed" in out
    assert "job 1 (seed=2 dry_run=True train.num_rollout=1 tracking.progress=False): dry run passed" in out
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "mlruns").exists()
    # the control: the same sweep without dry_run starts Ray (its parent run too, tracking on by default)
    assert sweep(*launcher, "seed=1,2", "tracking.enabled=false", *SMALL)[0] == RAY_STARTED


def test_a_sweeps_dry_run_whose_job_a_start_would_stop_exits_2_naming_it(sweep, tmp_path: Path, monkeypatch):
    """A check the precheck leaves to the job (the local GPUs: a sweep's jobs join its Ray) that fails in job 1's own
    dry run, stood in for at the preflight the job runs: job 0 passes, job 1 is named with the problem, exit 2."""
    from relax.runner import preflight as checks

    real = checks.preflight

    def preflight(cfg, *args, **kwargs):
        pre = real(cfg, *args, **kwargs)
        if cfg.seed == 2:
            pre.status["gpus"], pre.problems["gpus"] = "failed", "a local Ray instance gets 0 of the plan's 1 GPUs"
        return pre

    monkeypatch.setattr(checks, "preflight", preflight)
    code, out, err = sweep("seed=1,2", "dry_run=true", *SMALL)
    assert code == 2, out + err
    assert "job 0 (seed=1 dry_run=True train.num_rollout=1 tracking.progress=False): dry run passed" in out
    assert "job 1 (seed=2 dry_run=True train.num_rollout=1 tracking.progress=False): dry run FAILED" in out
    assert "relax-train: error: sweep dry run: a start would stop before Ray in 1 of 2 jobs (nothing started):\n" \
           "job 1:\n  dry run: a start would stop before Ray: a local Ray instance gets 0 of the plan's 1 GPUs" in err
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_sweep_that_is_a_dry_run_for_some_jobs_only_is_refused(sweep):
    code, out, err = sweep("dry_run=true,false", *SMALL)
    assert code == 2, out + err
    assert "dry_run is true for job 0 and false for job 1" in err


def saved_run(tmp_path: Path) -> Path:
    """A checkpoint's config.yaml of a run that saved every 2 steps and exported (non-default saving options)."""
    cfg = load_config(["train.save_interval=2", "train.save_hf=true", "train.keep_checkpoints=3"])
    directory = tmp_path / "step_000002"
    directory.mkdir()
    (directory / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return directory


def test_an_evaluation_only_sweep_of_a_saved_config_is_checked_with_each_jobs_overrides(sweep, tmp_path: Path):
    """Before: the precheck composed each job's config without its overrides, so every value of the saved config
    counted as set on the command line, and each job was refused ('train.save_hf=True has no effect:
    train.num_rollout=0'), although the same job as a single run evaluates (tests/config/test_reuse_for_evaluation)."""
    directory = saved_run(tmp_path)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for f in (a, b):
        f.write_text('{"prompt": "repeat 7", "label": "7"}\n')
    sets = f"+data.eval_sets=choice({{a:{a}}},{{a:{b}}})"
    code, out, err = sweep("-cp", str(directory), "-cn", "config", "hydra/launcher=relax_ray", "train.num_rollout=0",
                           sets, "tracking.progress=false")
    assert code == PARENT_STARTED, out + err  # every job passed the check: the sweep went on to its parent run
    assert "has no effect" not in err
    # the control: a saving option set on the command line is this sweep's, and refused in every job
    code, out, err = sweep("-cp", str(directory), "-cn", "config", "hydra/launcher=relax_ray", "train.num_rollout=0",
                           sets, "train.save_hf=true", "tracking.progress=false")
    assert code == 2, out + err
    assert "invalid config in 2 of 2 sweep jobs" in err and "train.save_hf=True has no effect" in err


def record_arms(monkeypatch) -> list:
    """The `tracking.arm` of each job's config as the launcher's precheck sees it (the job's, with what the launcher
    adds), appended to the list returned."""
    from relax.runner import sweep_check

    arms: list = []
    real = sweep_check.check_sweep_job

    def check(dc, overrides=None):
        arms.append(OmegaConf.select(dc, "tracking.arm", default=None))
        return real(dc, overrides=overrides)

    monkeypatch.setattr(sweep_check, "check_sweep_job", check)
    return arms


def test_an_evaluation_sweep_of_a_checkpoint_keeps_the_arm_of_the_run_it_reopens(sweep, tmp_path: Path, monkeypatch):
    """docs/training.md's evaluation sweep of one checkpoint over eval sets: each job continues the checkpoint and
    reopens its run. The launcher adds no derived `tracking.arm` to such a job: a reopened run's tags are set again
    from the job's config, so `+data.eval_sets={a:...}` would retag the training run's arm (1e84e17 let it, making
    tracking.arm a change a resume allows); and a resume with another tracking.arm is refused, as any config change."""
    from relax.runner import checkpoint

    written = load_config(["train.num_rollout=4", "train.save_interval=2", "train.save_hf=true",
                           "tracking.progress=false"])
    with checkpoint.Checkpoints(written) as ckpts:
        staging = ckpts.staging(2)
        (staging / "weights.bin").write_bytes(b"\0" * 8)
        ckpts.commit(staging, 2, {"sampler": {}})
    step = ckpts.save_dir / "step_000002"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for f in (a, b):
        f.write_text('{"prompt": "repeat 7", "label": "7"}\n')
    args = ["-cp", str(step), "-cn", "config", "hydra/launcher=relax_ray", f"train.resume={step}",
            "train.num_rollout=0", f"+data.eval_sets=choice({{a:{a}}},{{b:{b}}})", "tracking.progress=false"]
    arms = record_arms(monkeypatch)
    code, out, err = sweep(*args)
    assert code == PARENT_STARTED, out + err  # every job passed the check: the sweep went on to its parent run
    # no derived arm: each job reopens the training run, whose arm tag is set again from the job's config (relax.
    # tracking.mlflow_run.Tracker.reopen), so it stays the training run's (its saved tracking.arm, None: the algorithm)
    assert arms == [None, None]
    # a resume may not change tracking.arm (it would retag the reopened run): one set by the user is refused
    code, out, err = sweep(*args, "tracking.arm=evalA")
    assert code == 2, out + err
    assert "invalid config in 2 of 2 sweep jobs" in err and "tracking.arm: None -> evalA" in err
    # the control: a field a resume may not change (train.lr) is refused in every job, naming it
    code, out, err = sweep(*args, "train.lr=0.5")
    assert code == 2, out + err
    assert "invalid config in 2 of 2 sweep jobs" in err and "train.lr: 0.001 -> 0.5" in err
    assert "tracking.arm: None" not in err  # the arm is no difference


def test_a_sweep_of_a_saved_config_runs_on_relaxs_launcher_as_a_sweep_of_relaxs_config(sweep, tmp_path: Path):
    """A run's saved config names no launcher: `-m -cp <checkpoint> -cn config` ran on Hydra's basic launcher (no
    check of every job before the first starts, jobs one after another, no parent run, no table), while the docs'
    sweeps run on relax_ray, conf/config.yaml's. Now relax-train adds hydra/launcher=relax_ray; one given is kept."""
    directory = saved_run(tmp_path)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for f in (a, b):
        f.write_text('{"prompt": "repeat 7", "label": "7"}\n')
    args = ["-cp", str(directory), "-cn", "config", "train.num_rollout=0",
            f"+data.eval_sets=choice({{a:{a}}},{{a:{b}}})", "tracking.progress=false", "dry_run=true"]
    code, out, err = sweep(*args)
    assert code == 0, out + err
    assert "sweep dry run: 2 jobs, every job's config valid" in out  # relax_ray's dry run
    assert "Launching 2 jobs locally" not in out + err
    # the note on the saving options an evaluation leaves aside: once per job, by the job (its dry run), as a single
    # run prints it; not again by the launcher's check of every job before any starts
    assert err.count("train.save_interval=2, train.keep_checkpoints=3, train.save_hf=True (the training run's) do "
                     "not apply") == 2, err
    # the control: Hydra's basic launcher, given, runs each job's dry run in turn, and says so
    code, out, err = sweep(*args, "hydra/launcher=basic")
    assert code == 0, out + err
    assert "Launching 2 jobs locally" in out + err and "sweep dry run" not in out


def test_a_sweeps_dry_run_gives_each_job_the_arm_and_checkpoint_directory_the_sweep_gives_it(sweep, tmp_path: Path,
                                                                                              monkeypatch):
    """A sweep over a key that does not name the run (train.lr): the real sweep tags each job with its derived arm
    (`tracking.arm=train.lr=1e-05`), which names its default checkpoint directory (<arm>-seed<seed>). Before, the dry
    run composed the jobs without it, so both claimed `grpo-seed1` and the dry run was refused ('... is also job 1's:
    two jobs would write the same files') while the sweep itself passes that check."""
    import os

    from relax.runner import checkpoint
    from relax.runner.plan import SWEEP_RAY_ENV

    real, seen = checkpoint.resolve_save_dir, []

    def resolve_save_dir(cfg, cwd=None):  # each job's checkpoint directory, in the precheck and in its own dry run
        path = real(cfg, cwd)
        seen.append(("dry run" if SWEEP_RAY_ENV in os.environ else "precheck", cfg.train.lr, path.name))
        return path

    monkeypatch.setattr(checkpoint, "resolve_save_dir", resolve_save_dir)
    code, out, err = sweep("train.lr=1e-5,2e-5", "dry_run=true", *SMALL)
    assert code == 0, out + err
    assert "is also job" not in err and "sweep dry run: 2 jobs" in out
    expected = {(1e-5, "train.lr=1e-05-seed1"), (2e-5, "train.lr=2e-05-seed1")}
    for phase in ("precheck", "dry run"):
        assert {(lr, name) for p, lr, name in seen if p == phase} == expected, seen
    assert not (tmp_path / "checkpoints").exists()
    # the control: without tracking the real sweep adds no arm either, and the two jobs do share one directory
    code, out, err = sweep("train.lr=1e-5,2e-5", "dry_run=true", "tracking.enabled=false", *SMALL)
    assert code == 2, out + err
    assert "grpo-seed1 is also job 1's: two jobs would write the same files" in err


@pytest.mark.parametrize(("defaults", "added"), [(None, True), (["override hydra/launcher: basic", "_self_"], False),
                                                 ([{"override /hydra/launcher": "relax_ray"}, "_self_"], False),
                                                 (["_self_"], True)])
def test_relax_train_adds_its_launcher_to_a_sweep_of_a_config_that_chooses_none(tmp_path: Path, defaults, added):
    """A run's saved config (no defaults list) or one whose defaults choose no launcher gets relax_ray; a config whose
    defaults list chooses one keeps it (before, `override hydra/launcher: basic` was switched to relax_ray)."""
    import yaml

    from relax.cli.command_line import RELAX_LAUNCHER, own_config_launcher

    entries = [yaml.safe_load(d) if isinstance(d, str) and ":" in d else d for d in defaults or []]
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({**({"defaults": entries} if defaults else {}), "seed": 3}))
    args = ["-m", "-cp", str(tmp_path), "-cn", "exp", "seed=1,2"]
    assert (own_config_launcher(args) == [*args, RELAX_LAUNCHER]) is added
    assert own_config_launcher([*args[:3], "--config-name=exp.yaml", *args[5:]])[-1:] == ([RELAX_LAUNCHER] if added
                                                                                          else ["seed=1,2"])
    # the control: no -m, or a launcher on the command line, is left alone whatever the config
    assert own_config_launcher(args[1:]) == args[1:]
    assert own_config_launcher([*args, "hydra/launcher=basic"]) == [*args, "hydra/launcher=basic"]
