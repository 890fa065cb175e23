"""relax-train as a user runs it: a subprocess, its exit code, stdout and stderr."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts processes (tests/README.md)


def relax_train(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax.cli.train", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_dry_run_prints_plan_and_starts_nothing(tmp_path):
    out = relax_train("algorithm=rloo", "dry_run=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Service graph: algorithm=rloo" in out.stdout
    assert "actor" in out.stdout and "rollout" in out.stdout
    assert "reference" not in out.stdout  # no KL term, no reference role
    assert not (tmp_path / "mlflow.db").exists()
    # a model without weights: the plan is printed, and the dry run stops as the start would (tests/cli/
    # test_dry_run_checks.py: every check before Ray)
    env = {k: v for k, v in os.environ.items() if k != "MODEL_DIR"}
    out = relax_train("algorithm=rloo", "model=qwen3_0.6b", "dry_run=true", cwd=tmp_path, env=env)
    assert out.returncode == 2 and "Service graph: algorithm=rloo" in out.stdout
    assert "$MODEL_DIR is not set" in out.stderr and "Traceback" not in out.stderr


def test_dry_run_shows_reference_and_critic_when_needed(tmp_path):
    out = relax_train("algorithm=ppo", "dry_run=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "critic" in out.stdout and "advantages" in out.stdout
    out = relax_train("algorithm=cispo", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.001",
                      "dry_run=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "reference" in out.stdout and "KL loss" in out.stdout


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
    (["algorithm=nope"], "algorithm/nope"),  # unknown group option
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
