"""Evaluating a real checkpoint with its run's own config, as `relax-train --help` and docs/training.md show:
`-cp <checkpoint> -cn config train.resume=<checkpoint> train.num_rollout=0` (review-user #4). The run saved every
step and exported (train.save_interval=1, train.save_hf=true): the evaluation needs neither retyped, evaluates the
checkpoint in its reopened MLflow run, and writes nothing (no checkpoint, the run's hf/ export untouched)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax.config import load_config, to_relax_config
from relax.config.validate import ConfigError
from relax.runner.checkpoint import step_dir
from relax.runner.train import run

EVAL = ("train.eval_interval=1", "data.num_eval_prompts=4", "model.dtype=float32")


def files(directory: Path) -> dict[str, tuple[str, int]]:
    """Each file under `directory`: (its SHA-256, its mtime in ns)."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_checkpoint_is_evaluated_with_its_runs_saved_config(in_process, small_run, tmp_path, capsys):
    trained = run(load_config(small_run(*EVAL, "train.save_interval=1", "train.save_hf=true", steps=1)),
                  output_dir=tmp_path / "out")
    ckpt = step_dir(tmp_path / "ckpt", 1)
    export = files(tmp_path / "ckpt" / "hf")
    assert export and (ckpt / "config.yaml").is_file()
    overrides = [f"train.resume={ckpt}", "train.num_rollout=0", "tracking.progress=true"]
    with initialize_config_dir(config_dir=str(ckpt), version_base=None):
        dc = compose(config_name="config", overrides=overrides)
    with pytest.raises(ConfigError, match="train.save_hf=True has no effect"):  # the control: as before the fix
        to_relax_config(dc)
    capsys.readouterr()
    cfg = to_relax_config(dc, overrides=overrides)
    assert "the saved config's train.save_interval=1, train.save_hf=True (the training run's) do not apply" in \
        capsys.readouterr().err
    again = run(cfg, output_dir=tmp_path / "out-eval")
    assert again.run_id == trained.run_id  # the run's MLflow run, reopened
    assert [step for step, _ in again.history] == [1]
    assert any(key.startswith("eval/digits/") for key in again.history[0][1])
    err = capsys.readouterr().err
    assert "Relax run finished (evaluation only: nothing trained)" in err and "the checkpoint of step 1" in err
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_000001"]  # no new checkpoint
    assert files(tmp_path / "ckpt" / "hf") == export  # not exported again
