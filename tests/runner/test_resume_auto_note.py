"""`train.resume=auto` with no checkpoint in the run's directory starts a new run at step 1 (as verl and TRL do), but
no longer silently: the start and the dry run's checkpoints line say so, and name checkpoints of the same experiment
whose config differs only in the seed or run name (the directory is named by them, so a changed seed finds nothing:
most often the run the user meant). Before, `seed=2 train.resume=auto` after a seed-1 run trained from step 0 with
nothing said, and the dry run's line read "save dir free and creatable; train.resume's checkpoint".

Real commits (`Checkpoints.commit`; only the weights are a stand-in file), the real start's check
(`preflight(..., stack=...)`, which enters `Checkpoints`) and the dry run through relax-train."""

from __future__ import annotations

import contextlib
from pathlib import Path

from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.runner import checkpoint
from relax.runner.preflight import preflight

SMALL = ["train.num_rollout=1", "tracking.progress=false", "tracking.system_metrics=false"]


def _commit(*overrides: str) -> Path:
    cfg = load_config([*overrides, *SMALL])
    with checkpoint.Checkpoints(cfg) as ckpts:
        staging = ckpts.staging(1)
        (staging / "weights.bin").write_bytes(b"\0" * 8)
        return ckpts.commit(staging, 1, {"sampler": {}})


def _checkpoints_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.split()[1:2] == ["checkpoints"]]
    return line


def test_a_changed_seed_is_said_to_start_a_new_run(tmp_path: Path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    seed1 = _commit("seed=1")
    _commit("seed=3", "train.lr=0.5")  # another config: not the same run under another seed
    seed2_dir = tmp_path / "checkpoints" / "relax" / "grpo-seed2"
    capfd.readouterr()

    code, out, err = relax_train(["seed=2", "train.resume=auto", "dry_run=true", *SMALL], capfd)
    assert code == 0, out + err
    line = _checkpoints_line(out)
    assert line.split()[0] == "ok"
    assert f"train.resume=auto: no checkpoint in {seed2_dir}, so this run starts at step 1 as a new run" in line
    assert f"{seed1} (step 1, seed=1)" in line and "seed3" not in line, line

    # the real start's check before Ray says it too (and, as before, starts the new run)
    cfg = load_config(["seed=2", "train.resume=auto", *SMALL])
    with contextlib.ExitStack() as stack:
        pre = preflight(cfg, stack=stack)
        assert pre.ok and pre.checkpoints is not None and pre.checkpoints.resume is None
    err = capfd.readouterr().err
    assert (f"relax-train: note: train.resume=auto: no checkpoint in {seed2_dir}, so this run starts at step 1 as a "
            f"new run. Checkpoints of the same config with another seed or run name: {seed1} (step 1, seed=1)") in err

    # control: the seed whose checkpoint exists continues it, and nothing is said of a new run
    code, out, err = relax_train(["seed=1", "train.resume=auto", "dry_run=true", *SMALL], capfd)
    assert code == 0, out + err
    assert f"train.resume=auto continues {seed1} (step 1)" in _checkpoints_line(out)
    assert "new run" not in out + err


def test_nothing_anywhere_says_only_that_the_run_starts_as_a_new_run(tmp_path: Path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train(["train.resume=auto", "dry_run=true", *SMALL], capfd)
    assert code == 0, out + err
    save_dir = tmp_path / "checkpoints" / "relax" / "grpo-seed1"
    assert _checkpoints_line(out).endswith(
        f"train.resume=auto: no checkpoint in {save_dir}, so this run starts at step 1 as a new run")
    # without train.resume the line says what the check covers, as before
    code, out, err = relax_train(["dry_run=true", *SMALL], capfd)
    assert "save dir free and creatable; train.resume's checkpoint" in _checkpoints_line(out)
