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


def test_an_evaluation_sweep_of_a_checkpoint_is_not_refused_for_the_arm_the_sweep_tags_its_jobs_with(sweep,
                                                                                                     tmp_path: Path):
    """docs/training.md's evaluation sweep of one checkpoint over eval sets: the launcher adds each job's derived
    `tracking.arm` (`+data.eval_sets={a:...}`), a tag of the job's MLflow run (a reopened run keeps its own); before,
    the checkpoint's config (arm None) then differed from every job's, and each job was refused ('was written with a
    different config ... tracking.arm: None -> ...'). A dry run adds no arm (it records nothing), so it passed."""
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
    code, out, err = sweep(*args)
    assert code == PARENT_STARTED, out + err  # every job passed the check: the sweep went on to its parent run
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
    # the control: Hydra's basic launcher, given, runs each job's dry run in turn, and says so
    code, out, err = sweep(*args, "hydra/launcher=basic")
    assert code == 0, out + err
    assert "Launching 2 jobs locally" in out + err and "sweep dry run" not in out
