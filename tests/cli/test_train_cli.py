"""relax-train as a user runs it: its exit code, stdout and stderr. The refusals and --help run in a `relax-train`
process of their own (they stop before the plan is built); the dry runs, which build the plan and run every check
before Ray, run the CLI's entry point in this process (tests/relax_train_inprocess.py): a process of their own
imports torch and the modeling code again for each, and the entry point and its exit codes are the same."""

from __future__ import annotations

import subprocess
import sys

import pytest
from relax_train_inprocess import relax_train as relax_train_here

pytestmark = pytest.mark.slow  # starts processes (tests/README.md)


def relax_train(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax.cli.train", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_dry_run_prints_plan_and_starts_nothing(tmp_path, capfd, monkeypatch, ray_not_started):
    monkeypatch.chdir(tmp_path)  # the default tracking store, sqlite:///mlflow.db, would land here
    code, out, err = relax_train_here(["algorithm=rloo", "dry_run=true"], capfd)
    assert code == 0, err
    assert "Service graph: algorithm=rloo" in out
    assert "actor" in out and "rollout" in out
    assert "reference" not in out  # no KL term, no reference role
    assert not (tmp_path / "mlflow.db").exists() and not ray_not_started
    # a model without weights: the plan is printed, and the dry run stops as the start would (tests/cli/
    # test_dry_run_checks.py: every check before Ray)
    monkeypatch.delenv("MODEL_DIR", raising=False)
    code, out, err = relax_train_here(["algorithm=rloo", "model=qwen3_0.6b", "dry_run=true"], capfd)
    assert code == 2 and "Service graph: algorithm=rloo" in out
    assert "$MODEL_DIR is not set" in err and "Traceback" not in err


def test_dry_run_shows_reference_and_critic_when_needed(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train_here(["algorithm=ppo", "dry_run=true"], capfd)
    assert code == 0, err
    assert "critic" in out and "advantages" in out
    code, out, err = relax_train_here(["algorithm=cispo", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.001",
                                       "dry_run=true"], capfd)
    assert code == 0, err
    assert "reference" in out and "KL loss" in out


def test_invalid_config_exits_2_naming_the_field_without_traceback(tmp_path):
    out = relax_train("algorithm=m2po", "train.context_parallel_size=2", "dry_run=true", cwd=tmp_path)
    assert out.returncode == 2
    assert "context_parallel_size" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_every_violation_reported_at_once(tmp_path):
    out = relax_train("algorithm=rloo", "rollout.rollout_batch_size=4", "train.global_batch_size=64",
                      "rollout.temperature=0", "algorithm.kl_coef=0.1", "dry_run=true", cwd=tmp_path)
    assert out.returncode == 2
    assert "(3 problems)" in out.stderr
    assert "(4*8=32) must equal train.global_batch_size (64)" in out.stderr


@pytest.mark.parametrize("args,needle", [
    (["algorithm.kl2_budget=0.1"], "kl2_budget"),  # key of another algorithm
    (["algorithm=nope"], "algorithm=nope: config group algorithm has no option 'nope'"),  # unknown group option
    (["rollout.temperature=hot"], "rollout.temperature"),  # bad type
    (["train.no_such_key=1"], "no_such_key"),  # unknown key
])
def test_hydra_errors_are_one_clear_message(args, needle, tmp_path):
    out = relax_train(*args, "dry_run=true", cwd=tmp_path)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert "_schema" not in out.stderr


def test_help_lists_groups_and_options():
    out = relax_train("--help")
    assert out.returncode == 0
    for word in ("algorithm", "rloo", "m2po", "model", "qwen3_0.6b", "cluster", "8xgpu", "rollout", "sglang"):
        assert word in out.stdout


def test_cfg_job_prints_composed_config(tmp_path):
    out = relax_train("algorithm=sapo", "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tau_pos" in out.stdout
