"""Vision-language runs of the algorithms that bring a model of their own: PPO's critic and on-policy distillation's
teacher, each scoring the rows with their images (`model=tiny_vl data=shapes`, roles in this process).

The teacher's log-probs are checked against the engine's: a teacher that is the policy's own initial weights (the
tiny model saved as a Hugging Face directory with its tokenizer and image processor) gives, at step 0, the log-prob
the engine sampled each token with (fp32, < 1e-5); a teacher of other weights does not (the control); a text-only
teacher is rejected before start (tests/data/test_shapes.py). The critic's values are checked against an
independent computation in tests/models/test_vision_critic.py; here PPO trains end to end.
"""

from __future__ import annotations

import math

import pytest

from relax.config import load_config
from relax.config.schema import ModelConfig
from relax.data.images import build_tiny_vl_processor, build_tiny_vl_tokenizer
from relax.models.hf import build_model
from relax.runner.cluster import Cluster
from relax.runner.train import run

pytestmark = pytest.mark.slow

SEED = 7


def _vl_dir(path, seed: int):
    """tiny_vl (model.arch=qwen2_5_vl) of `seed`'s initial weights as a Hugging Face directory."""
    tokenizer = build_tiny_vl_tokenizer()
    model = build_model(ModelConfig(name="tiny_vl", arch="qwen2_5_vl", dtype="float32"), len(tokenizer),
                        tokenizer.pad_token_id, seed=seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    build_tiny_vl_processor(tokenizer).image_processor.save_pretrained(str(path))
    return path


def _base(small_run, *extra: str) -> list[str]:
    return small_run("model=tiny_vl", "data=shapes", "model.dtype=float32", f"seed={SEED}", "tracking.enabled=false",
                     *extra)


def test_ppo_trains_a_vision_language_model(in_process, small_run, tmp_path, monkeypatch):
    """Two PPO steps end to end; the critic's role is asked for the values of rows that hold their images."""
    seen = []
    original = Cluster.values

    def record(self, samples):
        seen.append(samples.vision)
        return original(self, samples)

    monkeypatch.setattr(Cluster, "values", record)
    result = run(load_config(_base(small_run, "algorithm=ppo")), output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    for _, metrics in result.history:
        assert math.isfinite(metrics["critic/value_loss"]) and math.isfinite(metrics["critic/grad_norm"])
        assert metrics["rollout/images_per_sample"] == 1.0
    assert seen and all(v is not None and all(row is not None for row in v) for v in seen)


@pytest.fixture
def teacher_calls(monkeypatch) -> list:
    """(samples, the teacher's log-probs) of every call of the run's teacher."""
    calls = []
    original = Cluster.teacher_logprobs

    def record(self, samples):
        out = original(self, samples)
        calls.append((samples, out))
        return out

    monkeypatch.setattr(Cluster, "teacher_logprobs", record)
    return calls


@pytest.mark.parametrize("teacher_seed,same", [(SEED, True), (SEED + 1, False)])
def test_a_vision_language_teacher_scores_with_the_images(in_process, small_run, tmp_path, teacher_calls,
                                                          teacher_seed, same):
    teacher = _vl_dir(tmp_path / "teacher", teacher_seed)
    cfg = load_config(_base(small_run, "algorithm=opd", f"teacher.path={teacher}", "teacher.dtype=float32"))
    run(cfg, output_dir=tmp_path / "out")
    samples, logp = teacher_calls[0]
    assert samples.vision is not None and all(v is not None for v in samples.vision)
    diff = float((logp - samples.rollout_logp)[samples.response_mask.bool()].abs().max())
    assert (diff < 1e-5) if same else (diff > 1e-3), diff

