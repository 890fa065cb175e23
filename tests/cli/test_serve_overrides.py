"""relax-serve's Hydra overrides: a key given twice is refused, as relax-train refuses it (the one helper,
relax.cli.config_check.duplicate_problems), beside the config's other problems, before anything loads; Hydra would
take the last silently. The problems are listed as relax-train lists them (relax.cli.config_check.invalid_config).
The model named here does not exist, so a command line that passes goes on to that check."""

from __future__ import annotations

import pytest

from relax.cli import serve

MISSING_MODEL = ["model.source=hf", "model.path=/nonexistent/relax-serve-model"]
REFUSED = "relax-serve: error: invalid config ({} problem{}):"


def refused(*problems: str) -> list[str]:
    """relax-serve's lines for a config with `problems`, relax-train's list (`invalid config (n problems):`)."""
    n = len(problems)
    return [REFUSED.format(n, "s" if n > 1 else ""), *(f"  - {p}" for p in problems)]


def start(capsys, *overrides: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        serve.main(["--port", "0", *MISSING_MODEL, *overrides])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overrides,says", [
    (["train.lr=1e-5", "train.lr=2e-5"], "train.lr is given twice: train.lr=1e-5 and train.lr=2e-5"),
    (["train.lr=1e-5", "+train.lr=2e-5", "++train.lr=3e-5"],
     "train.lr is given 3 times: train.lr=1e-5, +train.lr=2e-5 and ++train.lr=3e-5"),
    (["model=tiny", "model=smollm2_135m"], "model is given twice: model=tiny and model=smollm2_135m"),
])
def test_a_key_given_twice_is_refused_naming_the_key_and_each_value(capsys, overrides, says):
    code, err = start(capsys, *overrides)
    assert code == 2
    assert err.strip().splitlines() == refused(f"{says}; only the last would count: give it once"), err


def test_a_repeat_is_named_beside_the_configs_other_problems(capsys):
    code, err = start(capsys, "train.lr=1e-5", "train.lrr=1", "train.lr=2e-5")
    assert code == 2
    assert err.strip().splitlines() == refused(
        "train.lr is given twice: train.lr=1e-5 and train.lr=2e-5; only the last would count: give it once",
        "unknown key train.lrr (did you mean train.lr?)"), err
    # `+key` after `key`, a deletion beside a value: Relax's message alone (before: Hydra's refusal of the last as
    # written, "Could not append to config ...", "... does not support deletion", joined after it in one line)
    code, err = start(capsys, "train.lr=1e-5", "+train.lr=2e-5")
    assert code == 2
    assert err.strip().splitlines() == refused(
        "train.lr is given twice: train.lr=1e-5 and +train.lr=2e-5; only the last would count: give it once"), err
    code, err = start(capsys, "train.lr=1e-5", "~train.lr", "train.num_rollout=x")
    assert code == 2
    assert err.strip().splitlines() == refused(
        "train.lr is both set and deleted: train.lr=1e-5 sets it, ~train.lr deletes it; they contradict each other: "
        "give one of them",
        "train.num_rollout=x: train.num_rollout takes an int, not the string 'x'"), err


def test_config_problems_are_listed_as_relax_train_lists_them(capsys):
    """relax-serve's problems in relax-train's `invalid config (n problems)` list, one a line (before: its own
    `invalid config: a; b` on one line)."""
    from relax.cli.config_check import problems

    overrides = ["train.lr=abc", "train.num_rollout=x"]
    code, err = start(capsys, *overrides)
    assert code == 2
    assert err.strip() == f"relax-serve: error: {problems(overrides)}", err
    assert err.strip().splitlines() == refused(
        "train.lr=abc: train.lr takes a float (a number: 0.5, 1e-5), not the string 'abc'",
        "train.num_rollout=x: train.num_rollout takes an int, not the string 'x'"), err


def test_hydras_keys_and_groups_are_refused_as_doing_nothing_in_relax_serve(capsys):
    """relax-serve runs no Hydra job (no chdir, no run directory, no Hydra logging, no launcher), so each override of
    Hydra's own keys and groups is refused in the one list, beside the config's other problems, rather than accepted
    to do nothing (before: `hydra.job.chdir=true`, `hydra.run.dir=...`, `hydra/job_logging=disabled` passed the check
    and went on to start). `+` on a key that is there and `~` of a schema key: relax-train's lines."""
    no_job = "relax-serve runs no Hydra job, so this override has no effect here: leave it out"
    code, err = start(capsys, "hydra.job.chdir=true", "hydra.run.dir=/tmp/relax-serve-run",
                      "hydra/job_logging=disabled", "~hydra.job.name", "hydra/launcher=basic", "~train.lr")
    assert code == 2
    assert err.strip().splitlines() == refused(
        f"hydra.job.chdir=true: {no_job}",
        f"hydra.run.dir=/tmp/relax-serve-run: {no_job}",
        f"hydra/job_logging=disabled: {no_job}",
        f"~hydra.job.name: {no_job}",
        f"hydra/launcher=basic: {no_job}",
        "~train.lr: train.lr is a key of the schema (every config has it), so it cannot be deleted: to keep the "
        "value the config gives it (train.lr=0.001), leave ~train.lr out; to change it: train.lr=VALUE"), err
    code, err = start(capsys, "hydra.job.chdir=true", "train.lr=1e-5", "train.lr=2e-5")
    assert err.strip().splitlines() == refused(
        "train.lr is given twice: train.lr=1e-5 and train.lr=2e-5; only the last would count: give it once",
        f"hydra.job.chdir=true: {no_job}"), err
    code, err = start(capsys, "+train.lr=2e-5")
    assert err.strip().splitlines() == refused(
        "+train.lr=2e-5: train.lr is already in the config, and + adds a key it does not have: set it with "
        "train.lr=2e-5 (++train.lr=2e-5 sets it whether or not it is there)"), err
    # the control: the same config without Hydra's overrides goes on to the missing model
    code, err = start(capsys, "++train.lr=2e-5")
    assert code == 2 and "invalid config" not in err and "/nonexistent/relax-serve-model" in err, err


def test_hydra_searchpath_adds_a_directorys_config_groups_to_relax_serves_config(tmp_path, capsys):
    """hydra.searchpath does take effect in relax-serve: the config is composed with it, so a group option of the
    directory is chosen (its value is in the config relax-serve loads), and the start goes on to the missing model.
    The control: without it, the option is unknown."""
    import argparse

    conf = tmp_path / "myconf" / "algorithm"
    conf.mkdir(parents=True)
    (conf / "grpo_wide.yaml").write_text("defaults:\n  - grpo_schema\neps_clip_high: 0.28\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'myconf'}]"
    cfg = serve._load(argparse.Namespace(config=None, overrides=["algorithm=grpo_wide", searchpath]))
    assert cfg.algorithm.eps_clip_high == 0.28
    code, err = start(capsys, "algorithm=grpo_wide", searchpath)
    assert code == 2 and "invalid config" not in err and "/nonexistent/relax-serve-model" in err, err
    code, err = start(capsys, "algorithm=grpo_wide")
    assert code == 2 and "invalid config" in err and "grpo_wide" in err, err


def test_single_values_go_on_to_the_next_check(capsys):
    """The control: each key once passes, and the start stops at the missing model."""
    code, err = start(capsys, "train.lr=1e-5", "++rollout.temperature=0.7")
    assert code == 2
    assert "given twice" not in err and "/nonexistent/relax-serve-model" in err, err
