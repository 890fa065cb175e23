"""`relax-train model=tiny_vl data=shapes rollout=sglang` end to end on CPU: the shape prompts' images travel as
SGLang's `image_data` to an embedded server behind the real sglang-router (processes of their own, real HTTP), and
the trainer scores the servers' tokens with the same images (tests/sglang/test_image_data.py checks the parity
request by request and its negative control: blank images). The roles that drive the server run in this process
(`in_process`): the images over HTTP are the claim, not Ray (the servers as Ray actors, their weights from the
actor's process: tests/runner/test_sglang_training.py)."""

from __future__ import annotations

import math

import pytest

from relax.config import load_config
from relax.metrics import IMAGE_TOKEN_FRAC, IMAGES_PER_SAMPLE, STALENESS_MAX, TRAIN_ROLLOUT_LOGP_ABS_DIFF
from relax.runner.train import run
from tests.runner.test_sglang_training import SGLANG

pytestmark = pytest.mark.slow


def test_a_vision_language_model_trains_two_steps_through_sglang_servers(in_process, small_run, tmp_path):
    # one server (two and a killed one: tests/runner/test_sglang_training.py), a small batch of short answers
    cfg = load_config(small_run(*SGLANG, "rollout.num_replicas=1", "model=tiny_vl", "data=shapes",
                                "model.dtype=float32", "seed=1", "tracking.enabled=false",
                                "rollout.rollout_batch_size=2"))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    for _, m in result.history:
        assert m[STALENESS_MAX] == 0.0  # the servers answered with the weights of this very step
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-5  # the servers' log-probs with the images = the trainer's
        assert m[IMAGES_PER_SAMPLE] == 1.0 and 0.0 < m[IMAGE_TOKEN_FRAC] < 1.0
        assert "perf/vision_encode_time" not in m or not math.isnan(m["perf/vision_encode_time"])
