"""On-policy distillation end to end: a teacher trained by a Relax run and loaded from its export teaches a student
(the tiny model from scratch) the task without any reward signal (`algorithm.reward_coef=0`).

The runs use the real loop, roles and backends with the roles in this process (tests/inprocess_ray.py); the teacher
role as a Ray process of its own trains in tests/runner/test_training.py (`test_every_service_graph_trains_on_ray`).
The negative control distills from a teacher that knows nothing (an untrained model): the student then matches it as
well, but its reward does not rise, so the rise above is the teacher's knowledge and not a leak of the reward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess_ray import inprocess_ray

from relax.config import load_config
from relax.runner.errors import RunError
from relax.runner.train import run

# the tests share the module's teacher: one xdist worker runs them in a row
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distillation")]

QUIET = ["tracking.enabled=false", "tracking.progress=false", "cluster.cpus_per_node=1", "model.dtype=float32"]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> tuple[Path, list[float]]:
    """The tiny model trained by GRPO on the default task for 30 steps and exported (train.save_hf=true): its
    directory and its run's rewards."""
    tmp = tmp_path_factory.mktemp("teacher")
    cfg = load_config(["train.num_rollout=30", "train.save_hf=true", f"train.save_dir={tmp}/ckpt", *QUIET])
    with inprocess_ray():
        rewards = run(cfg, output_dir=tmp / "out").series("rollout/raw_reward")
    return tmp / "ckpt" / "hf", rewards


def distill(teacher_path: Path, tmp_path: Path, *extra: str):
    """20 steps of pure distillation of a student from scratch (another seed than the teacher's initial weights)."""
    cfg = load_config(["algorithm=opd", f"teacher.path={teacher_path}", "teacher.dtype=float32", "train.num_rollout=20",
                       "seed=2", "train.save=false", *QUIET, *extra])
    return run(cfg, output_dir=tmp_path / "out")


def learned(result) -> tuple[bool, bool, dict]:
    """(the teacher's KL halved: mean of the last 3 steps <= half the first 3's, the reward rose: mean of the last 5
    steps > the first 5's + 0.08, the series)."""
    kl, rewards = result.series("train/teacher_kl"), result.series("rollout/raw_reward")
    assert len(kl) == len(rewards) == 20 and len(result.series("rollout/teacher_logp_mean")) == 20
    return (mean(kl[-3:]) <= 0.5 * mean(kl[:3]), mean(rewards[-5:]) > mean(rewards[:5]) + 0.08,
            {"teacher_kl": kl, "reward": rewards})


def untrained_teacher(directory: Path) -> Path:
    """A teacher that knows nothing: the tiny model untrained (another seed than the student's), saved with its
    tokenizer."""
    from relax.data.tokenizer import load_tokenizer
    from relax.models.hf import build_model

    cfg = load_config([])
    tokenizer = load_tokenizer(cfg.model)
    build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, seed=123).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def test_a_student_learns_the_task_from_its_teacher_without_a_reward(teacher, in_process, tmp_path):
    path, teacher_rewards = teacher
    assert mean(teacher_rewards[-5:]) > mean(teacher_rewards[:5]) + 0.1, teacher_rewards  # the teacher knows it
    kl_halved, reward_rose, series = learned(distill(path, tmp_path))
    assert kl_halved and reward_rose, series


def test_negative_control_a_teacher_that_knows_nothing_teaches_no_reward(in_process, tmp_path):
    _, reward_rose, series = learned(distill(untrained_teacher(tmp_path / "untrained"), tmp_path))
    assert not reward_rose, series


@pytest.mark.parametrize("extra", [["train.mode=hybrid"], ["train.mode=fully_async", "rollout.partial_rollout=true"],
                                   ["data=guess_number", "rollout.max_turns=3", "rollout.max_episode_tokens=40"]],
                         ids=["hybrid", "fully_async-partial", "multi-turn"])
def test_the_teacher_scores_each_trained_sample_once_in_every_mode(extra, in_process, tmp_path, monkeypatch,
                                                                     trained_batches):
    """Whatever generated them (one step old, stale or interrupted samples; episodes whose observations are out of
    the loss), the teacher scores each trained sample once, in its step, and only the model's tokens carry its
    log-probs."""
    from relax.runner.cluster import Cluster

    scored: dict[int, list[int]] = {}
    original = Cluster.teacher_logprobs

    def teacher_logprobs(self, samples):
        out = original(self, samples)
        assert bool((out[samples.response_mask == 0] == 0).all())  # observations and padding: no teacher log-prob
        assert bool((out[samples.response_mask != 0] < 0).all())
        scored[len(scored)] = list(samples.sample_id)
        return out

    monkeypatch.setattr(Cluster, "teacher_logprobs", teacher_logprobs)
    path = untrained_teacher(tmp_path / "teacher")
    cfg = load_config(["algorithm=opd", f"teacher.path={path}", "train.num_rollout=3", "train.save=false",
                       "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=2", *QUIET, *extra])
    result = run(cfg, output_dir=tmp_path / "out")
    assert [step for step, _ in result.history] == [0, 1, 2]
    assert all(m["train/teacher_kl"] == m["train/teacher_kl"] for _, m in result.history)  # logged, finite
    assert scored == {step: list(trained_batches[step].sample_id) for step in range(3)}
    if "data=guess_number" in extra:  # episodes: observation tokens present in the sequence, out of the loss
        assert any(bool(((b.present() != 0) & (b.response_mask == 0)).any()) for b in trained_batches.values())


def test_a_teacher_of_another_tokenizer_is_rejected_before_anything_starts(ray_not_started, tmp_path):
    """SmolLM2's tokenizer is not the tiny model's: the run stops before Ray, naming both."""
    cfg = load_config(["algorithm=opd", "teacher=smollm2_135m", *QUIET, "train.save=false"])
    with pytest.raises(RunError) as err:
        run(cfg, output_dir=tmp_path / "out")
    message = str(err.value)
    assert "teacher=SmolLM2-135M-Instruct" in message and "model=tiny" in message and "tokenizer" in message
    assert not ray_not_started


def test_a_teacher_that_is_not_there_is_rejected_before_anything_starts(ray_not_started, tmp_path):
    cfg = load_config(["algorithm=opd", f"teacher.path={tmp_path / 'missing'}", *QUIET, "train.save=false"])
    with pytest.raises(RunError, match="teacher.path=.*missing"):
        run(cfg, output_dir=tmp_path / "out")
    assert not ray_not_started
