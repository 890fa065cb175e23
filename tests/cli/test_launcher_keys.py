"""The sweep launcher's options (`hydra.launcher.<name>=...`, `hydra/launcher=...`) are checked with the config's
(review-user #7): a name the launcher's config dataclass lacks, with or without `+`, is an unknown key with what was
meant, reported with every other problem, one `relax-train: error:` (exit 2), no traceback, nothing started; on a
run without `-m`, which starts no launcher, each is refused rather than accepted and ignored. The `hydra.*` keys
users pass (run/sweep dirs, search path, job settings, a launcher's real options) go on."""

from __future__ import annotations

import dataclasses

import pytest
from relax_train_inprocess import relax_train

from relax.cli.config_check import problems

SINGLE = "launcher options (hydra.launcher.*, hydra/launcher=...) apply to sweeps (-m) only"


def _refused(code: int, out: str, err: str) -> str:
    assert code == 2, out + err
    assert err.startswith("relax-train: error: "), err
    assert "Traceback" not in out + err and "TypeError" not in err and "HYDRA_FULL_ERROR" not in err
    assert "To append to your config use +" not in err
    return err


def _launcher_options() -> list[str]:
    """The relax_ray launcher's options, read off its config dataclass (the one Hydra instantiates it from)."""
    from hydra_plugins.relax_ray_launcher.config import RelaxRayLauncherConf

    return [f.name for f in dataclasses.fields(RelaxRayLauncherConf) if f.name != "_target_"]


@pytest.mark.parametrize("plus", ["", "+", "++"])
def test_a_misspelled_launcher_option_is_an_unknown_key_with_what_was_meant(plus, tmp_path, monkeypatch, capfd):
    """Before: Hydra's 'Could not override ...' with its '+' advice, which then failed with RelaxRayLauncher's
    TypeError; now both are the config's unknown key, with every other problem of the command line."""
    assert "max_concurrent_jobs" in _launcher_options()  # what the hint must name is a real option
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["-m", "seed=1,2", f"{plus}hydra.launcher.max_concurent_jobs=1",
                                 f"{plus}hydra.launcher.stop_timout_s=5", "train.num_rollout=2", "train.lrr=1",
                                 "dry_run=true"], capfd))
    lines = err.splitlines()
    assert lines[:4] == [
        "relax-train: error: invalid config (2 problems):",
        "  - unknown key hydra.launcher.max_concurent_jobs (did you mean hydra.launcher.max_concurrent_jobs?)",
        "  - unknown key hydra.launcher.stop_timout_s (did you mean hydra.launcher.stop_timeout_s?)",
        "invalid config in 2 of 2 sweep jobs (nothing started):"], err
    assert err.count("unknown key train.lrr (did you mean train.lr?)") == 2  # each job's, at the same time
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_option_of_another_launcher_names_the_chosen_launchers_options(tmp_path, monkeypatch, capfd):
    """hydra/launcher=basic (Hydra's own) has no options: the relax_ray launcher's are unknown keys there. A key
    inside a mapping option is added with `+` (as the control below does), and a launcher that is not there is named
    with those that are."""
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["-m", "hydra/launcher=basic", "seed=1,2", "hydra.launcher.max_concurrent_jobs=1",
                                 "dry_run=true"], capfd))
    assert err.splitlines() == [
        "relax-train: error: invalid config (1 problem):",
        "  - unknown key hydra.launcher.max_concurrent_jobs: the launcher hydra/launcher=basic has no option "
        "'max_concurrent_jobs' (it has no options)"], err
    err = _refused(*relax_train(["-m", "seed=1,2", "hydra.launcher.ray_init.num_cpus=2", "dry_run=true"], capfd))
    assert err.splitlines()[1] == ("  - unknown key hydra.launcher.ray_init.num_cpus: hydra.launcher.ray_init has no "
                                   "key 'num_cpus' to set; add it with +hydra.launcher.ray_init.num_cpus=..."), err
    err = _refused(*relax_train(["-m", "hydra/launcher=rayy", "seed=1,2", "dry_run=true"], capfd))
    assert "hydra/launcher=rayy: config group hydra/launcher has no option 'rayy'" in err
    assert "relax_ray" in err and "basic" in err  # its options


@pytest.mark.parametrize("override", ["hydra.launcher.max_concurrent_jobs=1", "+hydra.launcher.max_concurent_jobs=1",
                                      "hydra/launcher=basic", "hydra.launcher.stop_timeout_s=30"])
def test_a_launcher_option_without_m_is_refused_not_ignored(override, tmp_path, monkeypatch, capfd):
    """Before: the dry run (and the run) passed, the option ignored: a run without -m starts no launcher."""
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train([override, "train.num_rollout=2", "train.lrr=1", "dry_run=true"], capfd))
    assert err.splitlines()[:2] == [
        "relax-train: error: invalid config (2 problems):",
        f"  - {override}: {SINGLE}: a run without -m starts no launcher and would ignore it (drop it, or sweep with "
        "relax-train -m ...)"], err
    assert "unknown key train.lrr (did you mean train.lr?)" in err  # with the config's own problems
    assert list(tmp_path.iterdir()) == []
    # relax-submit checks with the same function: the job would be refused there before it is submitted
    assert SINGLE in problems([override, "train.num_rollout=2"], environment=False, start_checks=True)


@pytest.mark.parametrize("choice, hint", [("x", ""), ("relax_rey", " (did you mean hydra/launcher=relax_ray?)")])
def test_a_launcher_that_is_not_there_without_m_is_named_with_the_options(choice, hint, tmp_path, monkeypatch, capfd):
    """Before: `hydra/launcher=x` without -m got the sweeps-only advice, which does not say that x is no launcher
    (and -m would only meet that refusal). Now the line of a choice that names no option, as for the other
    hydra/<group>= choices and as with -m; a launcher that is there keeps the advice (the test above)."""
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train([f"hydra/launcher={choice}", "train.lrr=1", "dry_run=true"], capfd))
    line = (f"  - hydra/launcher={choice}: config group hydra/launcher has no option {choice!r}{hint}; its options: "
            "basic, relax_ray")
    assert err.splitlines()[:2] == ["relax-train: error: invalid config (2 problems):", line], err
    assert SINGLE not in err and "unknown key train.lrr (did you mean train.lr?)" in err
    assert line[4:] in problems(["-m", "seed=1,2", f"hydra/launcher={choice}"])  # the same words as with -m


@pytest.mark.parametrize("args", [
    ["-m", "seed=1,2", "hydra.launcher.max_concurrent_jobs=1", "hydra.launcher.stop_timeout_s=30",
     "hydra.launcher.num_cpus=2", "+hydra.launcher.ray_init.num_cpus=2", "hydra.launcher.address=null"],
    ["-m", "seed=1,2", "hydra/launcher=basic"],
    ["-m", "seed=1,2", "hydra.sweep.dir=sweeps/x", "hydra.sweep.subdir=${hydra.job.num}", "hydra.job.chdir=false"],
    ["hydra.run.dir=runs/x", "hydra.job.chdir=false", "hydra.job.name=mine", "hydra.searchpath=[file://{tmp}]"],
    ["-m", "seed=1,2", "hydra.launcher.max_concurrent_jobs=1", "hydra.searchpath=[file://{tmp}]"],
    ["--cfg", "hydra", "hydra.launcher.max_concurrent_jobs=3"],  # printed, not ignored
])
def test_the_hydra_keys_users_pass_go_on(args, tmp_path, monkeypatch):
    """The control: the launcher's real options in a sweep, and the run/sweep/job keys, are not refused."""
    monkeypatch.chdir(tmp_path)
    assert problems([*(a.replace("{tmp}", str(tmp_path)) for a in args), "train.num_rollout=2"]) is None


def test_a_launcher_option_on_a_run_of_its_own_config_is_refused(tmp_path, monkeypatch, capfd):
    """`relax-train -cp <dir> -cn config ...` (a run's saved config), which the command line's precheck leaves to
    Hydra: a launcher option there is refused by the run itself, before its dry run (before: accepted, ignored)."""
    from omegaconf import OmegaConf

    from relax.config.compose import compose

    saved = tmp_path / "saved"
    saved.mkdir()
    OmegaConf.save(compose(["train.num_rollout=2"]), saved / "config.yaml")
    monkeypatch.chdir(tmp_path)
    for launcher in (["+hydra.launcher.max_concurrent_jobs=1"],
                     ["hydra/launcher=relax_ray", "hydra.launcher.max_concurrent_jobs=1"]):
        err = _refused(*relax_train(["-cp", str(saved), "-cn", "config", *launcher, "train.lr=-1", "dry_run=true"],
                                    capfd))
        assert err.splitlines()[:2] == [f"relax-train: error: invalid config ({len(launcher) + 1} problems):",
                                        f"  - {launcher[0]}: {SINGLE}: a run without -m starts no launcher and would "
                                        "ignore it (drop it, or sweep with relax-train -m ...)"], err
        assert err.splitlines()[-1] == "  - train.lr=-1.0 must be > 0", err  # with the config's own problems
    code, out, err = relax_train(["-cp", str(saved), "-cn", "config", "dry_run=true"], capfd)  # the control
    assert code in (0, None) and "dry run: config valid" in out, err
