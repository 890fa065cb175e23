"""A resume refused because the config differs from the checkpoint's gives advice that fits what the run does
(review-user #4): an evaluation-only run (train.num_rollout=0) is pointed at evaluating the checkpoint with its run's
own config (`-cp <checkpoint> -cn config`), a training resume at running with the checkpoint's values or elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config import load_config
from relax.runner import checkpoint
from relax.runner.errors import RunError


def committed(tmp_path: Path) -> Path:
    """A committed checkpoint (a real commit; only its weight file is fake) of a run of experiment `teacher`."""
    written = load_config(["tracking.experiment=teacher", f"train.save_dir={tmp_path / 'run'}"])
    with checkpoint.Checkpoints(written) as ckpts:
        staging = ckpts.staging(1)
        (staging / "weights.bin").write_bytes(b"\0" * 8)
        return ckpts.commit(staging, 1, {"step": 1, "sampler": {}})


@pytest.mark.parametrize("num_rollout", [0, 6])
def test_the_advice_of_a_refused_resume_fits_an_evaluation(tmp_path, num_rollout):
    path = committed(tmp_path)
    now = load_config([f"train.save_dir={tmp_path / 'run'}", f"train.resume={path}",
                       f"train.num_rollout={num_rollout}"])  # tracking.experiment left at its default
    with pytest.raises(RunError) as exc:
        checkpoint.resume_point(now, tmp_path / "run", hashes=False)
    text = str(exc.value)
    assert "tracking.experiment: teacher -> relax" in text
    evaluate = f"To evaluate it, give its run's own config (its config.yaml) and the options to change: " \
               f"relax-train -cp {path} -cn config train.resume={path} train.num_rollout=0 ..."
    elsewhere = "start a new run elsewhere (tracking.run_name=... or train.save_dir=...)"
    if num_rollout == 0:
        assert evaluate in text and elsewhere not in text, text
    else:  # the control: a training resume keeps the advice for training
        assert elsewhere in text and evaluate not in text, text
